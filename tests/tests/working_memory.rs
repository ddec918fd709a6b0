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

    wm.put(
        &acme,
        &team_a,
        "plan",
        Bytes::from("step 3 of 7"),
        Some(Duration::from_secs(1)),
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
    assert_eq!(
        wm.get(&acme, &team_a, "plan").await.unwrap().as_deref(),
        Some(&b"step 3 of 7"[..])
    );
    assert_eq!(
        wm.get(&ident("other"), &team_a, "plan").await.unwrap(),
        None
    );

    wait_until("the 1s key to expire", Duration::from_secs(10), || {
        let wm = wm.clone();
        let (acme, team_a) = (acme.clone(), team_a.clone());
        async move { wm.get(&acme, &team_a, "plan").await.unwrap().is_none() }
    })
    .await;
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
