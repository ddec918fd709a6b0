//! Working memory: per-scope keys with per-key TTL, isolated by tenant and scope.

use std::time::Duration;

use bytes::Bytes;
use engram_schema::{Scope, ScopeKind};
use engram_testkit::{TestNats, ident, wait_until};

#[tokio::test]
async fn keys_expire_after_their_ttl_and_scopes_do_not_collide() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let wm = bus.working_memory().await.unwrap();
    let acme = ident("acme");
    let team_a = Scope::new(ScopeKind::Team, "team-a").unwrap();
    let team_ab = Scope::new(ScopeKind::Team, "team-ab").unwrap();

    // The key's TTL counts from when the server stored it, which is after `put_at`: the key
    // may be gone only once `ttl` has passed since then, and must be gone soon after.
    let ttl = Duration::from_secs(2);
    let put_at = std::time::Instant::now();
    wm.put(
        &acme,
        &team_a,
        "plan",
        Bytes::from("step 3 of 7"),
        Some(ttl),
    )
    .await
    .unwrap();
    wm.put(
        &acme,
        &team_ab,
        "plan",
        Bytes::from("other team"),
        Some(Duration::from_secs(60)),
    )
    .await
    .unwrap();
    let read = wm.get(&acme, &team_a, "plan").await.unwrap();
    if read.is_none() {
        assert!(
            put_at.elapsed() >= ttl,
            "the {ttl:?} key was gone after {:?}",
            put_at.elapsed()
        );
    } else {
        assert_eq!(read.as_deref(), Some(&b"step 3 of 7"[..]));
    }
    assert_eq!(
        wm.get(&ident("other"), &team_a, "plan").await.unwrap(),
        None
    );

    wait_until("the 2s key to expire", Duration::from_secs(30), || {
        let wm = wm.clone();
        let (acme, team_a) = (acme.clone(), team_a.clone());
        async move { wm.get(&acme, &team_a, "plan").await.unwrap().is_none() }
    })
    .await;
    assert!(
        put_at.elapsed() >= ttl,
        "the {ttl:?} key expired after only {:?}",
        put_at.elapsed()
    );
    assert_eq!(
        wm.get(&acme, &team_ab, "plan").await.unwrap().as_deref(),
        Some(&b"other team"[..]),
        "the longer TTL in the neighbouring scope is untouched"
    );

    assert!(
        wm.put(&acme, &team_a, "a.b", Bytes::new(), None)
            .await
            .is_err()
    );
    assert!(
        wm.put(&acme, &team_a, "*", Bytes::new(), None)
            .await
            .is_err()
    );
    assert!(
        wm.put(
            &acme,
            &team_a,
            "k",
            Bytes::new(),
            Some(Duration::from_millis(10))
        )
        .await
        .is_err()
    );
}
