//! A config reload re-checks every connection nats-server holds, and one whose CONNECT it
//! has not read yet has no credentials to check: the server refuses it as an authorization
//! violation although its key is admitted before and after. Engram reloads on every key
//! added or revoked, so a CLI or client connecting at that moment must not fail.
//!
//! The race is made certain rather than hoped for: a loopback relay between the client and a
//! real secured server holds the client's first CONNECT until the server has reloaded.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use engram_bus::Bus;
use engram_testkit::TestNats;
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpListener, TcpStream};

/// Relays connections to `upstream`. The first one's client bytes are held until
/// `release` fires, after `held` has said the server's INFO reached the client (so the
/// server holds the connection, without its CONNECT). Returns the relay's address and how
/// many connections it took.
async fn relay(
    upstream: std::net::SocketAddr,
    held: tokio::sync::oneshot::Sender<()>,
    release: tokio::sync::oneshot::Receiver<()>,
) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let taken = Arc::new(AtomicUsize::new(0));
    let count = taken.clone();
    tokio::spawn(async move {
        let mut first = Some((held, release));
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            count.fetch_add(1, Ordering::SeqCst);
            let server = TcpStream::connect(upstream).await.unwrap();
            let (mut client_rx, mut client_tx) = client.into_split();
            let (mut server_rx, mut server_tx) = server.into_split();
            let hold = first.take();
            tokio::spawn(async move {
                // The server speaks first (INFO); its bytes always pass at once.
                let down = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut server_rx, &mut client_tx).await;
                    let _ = client_tx.shutdown().await;
                });
                if let Some((held, release)) = hold {
                    // The client answers INFO with CONNECT at once; give the INFO time to
                    // arrive, then let the test reload the server before the CONNECT passes.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let _ = held.send(());
                    let _ = release.await;
                }
                let _ = tokio::io::copy(&mut client_rx, &mut server_tx).await;
                let _ = down.await;
            });
        }
    });
    (addr, taken)
}

#[tokio::test]
async fn a_handshake_a_config_reload_refuses_is_tried_again_and_succeeds() {
    let nats = TestNats::start_secured().await;
    let admin = nats.service(engram_access::RoleName::Admin);
    let upstream: std::net::SocketAddr = nats.url().trim_start_matches("nats://").parse().unwrap();
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel();
    let (addr, taken) = relay(upstream, held_tx, release_rx).await;

    let mut config = nats.config_as(&admin);
    config.url = format!("nats://{addr}");
    config.connect_timeout = Duration::from_secs(10);
    let connecting = tokio::spawn(Bus::connect(config));

    // When the server reloads while it holds the first connection without its CONNECT
    held_rx.await.unwrap();
    nats.nats
        .server
        .reload(Duration::from_secs(10))
        .await
        .unwrap();
    release_tx.send(()).unwrap();

    // Then the admin, whose key the server admits throughout, is connected all the same:
    // the first handshake was refused and a second one made.
    let bus = tokio::time::timeout(Duration::from_secs(30), connecting)
        .await
        .expect("connect did not finish")
        .unwrap()
        .unwrap_or_else(|e| panic!("a handshake raced by a reload must be tried again: {e}"));
    assert_eq!(taken.load(Ordering::SeqCst), 2, "one refused, one accepted");
    bus.client().flush().await.unwrap();
}

#[tokio::test]
async fn a_key_the_server_refuses_still_fails_after_its_few_attempts() {
    let nats = TestNats::start_secured().await;
    let stranger = engram_access::Credentials::generate_agent(
        engram_testkit::ident("acme"),
        engram_testkit::ident("nobody"),
    );
    // Bounded: a few short pauses, never the client's reconnect loop.
    let refused = tokio::time::timeout(
        Duration::from_secs(60),
        Bus::connect(nats.config_as(&stranger)),
    )
    .await
    .expect("a refused key must fail, not keep trying");
    match refused {
        Err(engram_bus::BusError::Unauthorized { .. }) => {}
        Err(e) => panic!("an unknown key must be refused as unauthorized: {e}"),
        Ok(_) => panic!("an unknown key was admitted"),
    }
}
