//! The payment gateway simulator itself (no database): deduplication by idempotency
//! key, key reuse with another request, fencing per account, injected faults (stall,
//! dropped reply, failure), the switch that turns idempotency off, and the log and
//! counts the other effect tests and the payments demo rely on.

use std::time::Duration;

use leasehold::testkit::gateway::{
    ChargeRequest, ChargeResult, Decision, Fault, FaultSchedule, Gateway, GatewayConfig,
    GatewayCounts, GatewayError,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

fn req(account: &str, cents: i64, reference: &str) -> ChargeRequest {
    ChargeRequest {
        account: account.into(),
        amount_cents: cents,
        reference: reference.into(),
    }
}

async fn bounded<T>(body: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), body)
        .await
        .expect("test exceeded its deadline")
}

#[tokio::test]
async fn same_key_same_request_returns_the_original_receipt_without_charging_again() {
    bounded(async {
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let c = gw.client();
        let r = req("acct-1", 1250, "acct-1/001");
        let first = c.charge("7/charge", Some(1), &r).await.unwrap();
        let ChargeResult::Applied(receipt) = first.clone() else {
            panic!("expected Applied, got {first:?}")
        };
        assert_eq!(receipt.charge_id, 1);
        assert_eq!(receipt.idempotency_key, "7/charge");
        assert_eq!(receipt.amount_cents, 1250);
        let again = c.charge("7/charge", Some(2), &r).await.unwrap();
        assert_eq!(again, ChargeResult::Duplicate(receipt.clone()));
        assert_eq!(c.lookup("7/charge").await.unwrap(), Some(receipt));
        assert_eq!(c.lookup("8/charge").await.unwrap(), None);
        assert_eq!(
            gw.counts(),
            GatewayCounts {
                requested: 2,
                applied: 1,
                duplicates: 1,
                ..Default::default()
            }
        );
        let log = gw.log();
        assert_eq!(
            log.iter().map(|e| e.decision).collect::<Vec<_>>(),
            vec![Decision::Applied, Decision::Duplicate]
        );
        assert_eq!(log[1].charge_id, Some(1), "a duplicate names the original");
        assert_eq!(log[1].fencing_token, Some(2));
    })
    .await
}

#[tokio::test]
async fn same_key_with_another_request_is_a_mismatch_and_charges_nothing() {
    bounded(async {
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let c = gw.client();
        c.charge("k", None, &req("acct-1", 100, "p1"))
            .await
            .unwrap();
        for other in [
            req("acct-1", 101, "p1"),
            req("acct-2", 100, "p1"),
            req("acct-1", 100, "p2"),
        ] {
            assert_eq!(
                c.charge("k", None, &other).await.unwrap(),
                ChargeResult::Mismatch
            );
        }
        let err = ChargeResult::Mismatch.into_job_result().unwrap_err();
        assert!(err.is_permanent(), "{err}");
        let counts = gw.counts();
        assert_eq!((counts.applied, counts.mismatches), (1, 3));
    })
    .await
}

#[tokio::test]
async fn a_token_lower_than_the_highest_seen_for_the_account_is_fenced() {
    bounded(async {
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let c = gw.client();
        let r = req("acct-1", 100, "p1");
        assert!(matches!(
            c.charge("a", Some(8), &r).await.unwrap(),
            ChargeResult::Applied(_)
        ));
        // Fencing comes first: even a duplicate key is refused with an old token.
        assert_eq!(
            c.charge("a", Some(7), &r).await.unwrap(),
            ChargeResult::Fenced { seen: 8, got: 7 }
        );
        assert_eq!(
            c.charge("b", Some(7), &req("acct-1", 5, "p2"))
                .await
                .unwrap(),
            ChargeResult::Fenced { seen: 8, got: 7 }
        );
        // The same token passes; other accounts have their own high-water mark; no
        // token, no fence.
        assert!(matches!(
            c.charge("a", Some(8), &r).await.unwrap(),
            ChargeResult::Duplicate(_)
        ));
        assert!(matches!(
            c.charge("c", Some(1), &req("acct-2", 5, "p3"))
                .await
                .unwrap(),
            ChargeResult::Applied(_)
        ));
        assert!(matches!(
            c.charge("d", None, &req("acct-1", 5, "p4")).await.unwrap(),
            ChargeResult::Applied(_)
        ));
        let err = ChargeResult::Fenced { seen: 8, got: 7 }
            .into_job_result()
            .unwrap_err();
        assert!(!err.is_permanent());
        assert!(err.message().contains("fencing token 7"), "{err}");
        let counts = gw.counts();
        assert_eq!(
            (counts.applied, counts.fenced, counts.duplicates),
            (3, 2, 1)
        );

        gw.set_fencing(false);
        assert!(matches!(
            c.charge("e", Some(1), &req("acct-1", 5, "p5"))
                .await
                .unwrap(),
            ChargeResult::Applied(_)
        ));
    })
    .await
}

#[tokio::test]
async fn a_dropped_reply_still_applies_and_the_retry_with_the_same_key_gets_the_receipt() {
    bounded(async {
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let c = gw.client();
        let r = req("acct-1", 100, "p1");
        let err = c
            .charge_with_fault("k", Some(1), &r, Some(Fault::DropReply))
            .await
            .unwrap_err();
        assert!(matches!(err, GatewayError::DroppedReply), "{err:?}");
        assert!(err.may_have_applied());
        assert_eq!(
            gw.counts().applied,
            1,
            "applied before the reply was dropped"
        );
        let retry = c.charge("k", Some(2), &r).await.unwrap();
        assert_eq!(retry.receipt().map(|r| r.charge_id), Some(1));
        assert!(matches!(retry, ChargeResult::Duplicate(_)));
        let counts = gw.counts();
        assert_eq!(
            (counts.requested, counts.applied, counts.replies_dropped),
            (2, 1, 1)
        );
        assert_eq!(gw.log()[0].fault, Some(Fault::DropReply));
    })
    .await
}

#[tokio::test]
async fn a_stall_past_the_client_timeout_is_decided_later_and_a_failure_charges_nothing() {
    bounded(async {
        let schedule = FaultSchedule::new()
            .on("p1", 1, Fault::Stall(Duration::from_millis(600)))
            .on("p2", 1, Fault::Fail("card network down".into()));
        let gw = Gateway::start(GatewayConfig {
            faults: schedule,
            ..Default::default()
        })
        .unwrap();
        let c = gw.client().with_timeout(Duration::from_millis(200));

        let err = c
            .charge("k1", Some(1), &req("a", 1, "p1"))
            .await
            .unwrap_err();
        assert!(matches!(err, GatewayError::Timeout(_)), "{err:?}");
        assert_eq!(gw.counts().requested, 1);
        assert_eq!(gw.counts().applied, 0, "still stalled");
        // The stalled request is decided when its stall ends, reply or no listener.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while gw.counts().applied == 0 {
            assert!(tokio::time::Instant::now() < deadline, "stall never ended");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The schedule picked the first occurrence only.
        assert!(matches!(
            c.charge("k1", Some(1), &req("a", 1, "p1")).await.unwrap(),
            ChargeResult::Duplicate(_)
        ));

        assert_eq!(
            c.charge("k2", Some(1), &req("a", 2, "p2")).await.unwrap(),
            ChargeResult::Failed("card network down".into())
        );
        assert!(!ChargeResult::Failed("x".into())
            .into_job_result()
            .unwrap_err()
            .is_permanent());
        assert!(matches!(
            c.charge("k2", Some(1), &req("a", 2, "p2")).await.unwrap(),
            ChargeResult::Applied(_)
        ));
        let counts = gw.counts();
        assert_eq!(
            (
                counts.requested,
                counts.applied,
                counts.failed,
                counts.stalled
            ),
            (4, 2, 1, 1)
        );
        assert_eq!(gw.applied_by_account()["a"], vec!["p1", "p2"]);
    })
    .await
}

#[tokio::test]
async fn with_idempotency_off_the_same_key_charges_twice() {
    bounded(async {
        let gw = Gateway::start(GatewayConfig {
            idempotency: false,
            ..Default::default()
        })
        .unwrap();
        let c = gw.client();
        let r = req("acct-1", 100, "p1");
        let first = c.charge("k", Some(1), &r).await.unwrap();
        let second = c.charge("k", Some(1), &r).await.unwrap();
        assert!(matches!(first, ChargeResult::Applied(_)));
        assert!(matches!(second, ChargeResult::Applied(_)));
        assert_eq!(gw.counts().applied, 2);
        assert_eq!(gw.applied_by_reference()["p1"], 2);
        // Lookups still find the first charge under the key.
        assert_eq!(c.lookup("k").await.unwrap().map(|r| r.charge_id), Some(1));
    })
    .await
}

#[tokio::test]
async fn garbage_gets_a_protocol_answer_and_a_stopped_gateway_is_unreachable() {
    bounded(async {
        let gw = Gateway::start(GatewayConfig::default()).unwrap();
        let addr = gw.addr();
        assert!(addr.ip().is_loopback());
        let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
        raw.write_all(b"{\"op\":\"refund\"}\n").await.unwrap();
        let mut line = String::new();
        BufReader::new(&mut raw).read_line(&mut line).await.unwrap();
        assert!(line.contains("\"invalid\""), "{line}");

        let client = gw.client().with_timeout(Duration::from_secs(2));
        gw.shutdown();
        let err = client
            .charge("k", None, &req("a", 1, "p"))
            .await
            .unwrap_err();
        assert!(
            matches!(err, GatewayError::Unreachable(_)),
            "after shutdown: {err:?}"
        );
        assert!(!err.may_have_applied());
    })
    .await
}
