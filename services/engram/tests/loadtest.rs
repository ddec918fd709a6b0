//! The fleet load test end to end, small: real nats-server, real `engram up` (this crate's
//! binary), simulated instances, ledger verification; and in chaos mode, projector processes
//! and the server killed with SIGKILL mid-run. The run must verify clean both times.

use std::time::Duration;

use engram_loadtest::fleet::target::{CLIENT_DIM, CLIENT_MODEL, EmbedderChoice};
use engram_loadtest::fleet::{self, FleetConfig};
use engram_schema::Embedding;

const ENGRAM: &str = env!("CARGO_BIN_EXE_engram");

/// Small and quick: client-supplied vectors (a debug build of MiniLM would dominate), half
/// the identities succeeded midway, every text write recalled and every fact checked.
///
/// The rate is a load a debug build on a shared 2-core machine may not sustain, and keeping
/// up is not what these tests check: `allow_overload` accepts a run that falls short, so its
/// exit code speaks of correctness alone (the headline still says whether it kept up).
fn config(out: &std::path::Path, duration_secs: u64) -> FleetConfig {
    FleetConfig {
        engram_bin: Some(ENGRAM.into()),
        embedder: EmbedderChoice::Client,
        instances: 12,
        team_size: 4,
        rate: 24.0,
        duration: Duration::from_secs(duration_secs),
        churn: 0.5,
        recall: 1.0,
        fact_check: 1.0,
        context_every: 3,
        query: 0.3,
        drain_limit: Duration::from_secs(120),
        reference: Duration::from_secs(2),
        out: out.to_path_buf(),
        seed: 7,
        allow_overload: true,
        ..FleetConfig::default()
    }
}

/// `engram <command>` against `url` with its home in `home`, embedding with the load test's
/// client vectors and serving HTTP on a port of its own; killed when dropped.
fn spawn_engram(home: &std::path::Path, url: &str, command: &str) -> tokio::process::Command {
    let config = home.join("engram.toml");
    std::fs::write(
        &config,
        format!(
            "[http]\nlisten = \"127.0.0.1:0\"\n\n[projectors.embedder]\nkind = \"client_supplied\"\nmodel = \"{CLIENT_MODEL}\"\ndim = {CLIENT_DIM}\n"
        ),
    )
    .unwrap();
    let mut cmd = tokio::process::Command::new(ENGRAM);
    cmd.arg("--home")
        .arg(home)
        .arg("--config")
        .arg(&config)
        .args(["--nats", url, command])
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// `event` carrying the vector the load test's client embedder gives its text.
fn with_client_vector(mut event: engram_schema::Envelope) -> engram_schema::Envelope {
    event.embedding = Some(Embedding {
        model: CLIENT_MODEL.to_owned(),
        vector: fleet::hash_vector(&event.content.text),
    });
    event
}

/// The steps the schedule holds. Every identity steps once a period from an offset within
/// its first period, so a load that lasts a whole number of periods holds exactly that many
/// steps per identity: fixed by the configuration, whatever the seed and the machine.
/// The steps a load of `load_secs` holds: one per instance per whole period. A chaos run's
/// load is `duration`, or more periods when a fault's recovery held it open.
fn scheduled_steps(config: &FleetConfig, load_secs: f64) -> u64 {
    let period = Duration::from_secs_f64(config.instances as f64 / config.rate).as_nanos();
    let duration = config.duration.as_nanos();
    assert_eq!(duration % period, 0, "the tests' loads last whole periods");
    let load = Duration::from_secs_f64(load_secs).as_nanos();
    assert!(load >= duration, "the load ran {load_secs} s");
    // Rounded: the length passed through an f64 of seconds.
    let periods = (load + period / 2) / period;
    config.instances as u64 * u64::try_from(periods).unwrap()
}

/// Every step the schedule holds was due, and either ran or was counted missed; every step
/// that ran made an append that was acknowledged or counted as failed: nothing the run
/// scheduled vanished without an outcome. How many were missed is the machine's speed, not
/// a property: it goes into the load verdict, which says so consistently, and the run's exit
/// code (`allow_overload` is on) depends on correctness alone.
fn assert_every_step_accounted_for(report: &fleet::report::FleetReport) {
    let p = &report.problems;
    assert!(!report.interrupted);
    assert_eq!(
        p.steps_due,
        scheduled_steps(&report.config, report.load_secs)
    );
    assert_eq!(
        p.steps_run + p.missed_steps,
        p.steps_due,
        "{}",
        report.markdown()
    );
    assert_eq!(
        report.appends + report.failed("append"),
        p.steps_run,
        "{}",
        report.markdown()
    );
    let load = &report.load;
    assert_eq!(
        (load.steps_reached, load.steps_missed),
        (p.steps_due, p.missed_steps)
    );
    assert_eq!(
        load.sustained,
        p.missed_steps * 100 <= p.steps_due * fleet::report::MISSED_STEPS_ALLOWED_PERCENT,
        "{load:?}"
    );
    // The headline gives both verdicts; a correct run's exit code is 0, sustained or not.
    let markdown = report.markdown();
    let headline = markdown.lines().next().unwrap();
    let (overall, load_word) = if load.sustained {
        ("PASSED", "SUSTAINED")
    } else {
        ("NOT SUSTAINED", "NOT SUSTAINED")
    };
    if report.passed() {
        let expected =
            format!("# Engram load test: {overall} — correctness PASSED; load {load_word}: ");
        assert!(headline.starts_with(&expected), "{headline}");
        assert_eq!(report.exit_code(), 0, "{headline}");
    }
}

/// Every read-your-writes check of `kind` that was due passed (skills may instead have been
/// superseded by a teammate's later record), and at least `least` were due, less one for
/// each step that never ran or whose append failed. What each identity writes and checks is
/// fixed by the seed, and an instance runs its steps in order (those it misses are the last
/// ones), so a slow machine can take away at most the checks of the steps it missed, one
/// each: a step appends one event, and only its kind is checked. (An append that fails skips
/// the rest of its step, which shifts the later draws; the runs here fail none.)
fn assert_checks_passed(report: &fleet::report::FleetReport, kind: &str, least: u64) {
    let o = report
        .problems
        .checks
        .get(kind)
        .unwrap_or_else(|| panic!("no {kind} checks: {:?}", report.problems.checks));
    let lost_steps = report.problems.missed_steps + report.failed("append");
    assert!(o.due + lost_steps >= least, "{kind}: {o:?}");
    assert_eq!(o.passed + o.superseded, o.due, "{kind}: {o:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_run_verifies_every_acknowledged_write_and_writes_its_report() {
    let out = tempfile::tempdir().unwrap();
    let report = fleet::run(config(out.path(), 8), std::future::pending())
        .await
        .expect("the run completes");
    assert!(report.passed(), "{}", report.markdown());
    // 12 instances at 2 steps/s each for 8 s: 192 steps.
    assert_eq!(report.problems.steps_due, 192);
    assert_every_step_accounted_for(&report);
    let verification = report.verification.as_ref().expect("verified");
    assert_eq!(
        (
            verification.lost,
            verification.duplicated,
            verification.seq_mismatch
        ),
        (0, 0, 0)
    );
    assert!(verification.stream_events >= report.appends);
    // Every projector applied each event up to its settled ledger once, and that ledger
    // covers every acknowledged append (else `error`). Not the whole stream as read last:
    // the consolidator may append its outputs after an earlier projector's ledger was read.
    for p in &verification.projectors {
        assert!(
            p.error.is_none() && p.digest_matches && p.applied_events == p.expected_events,
            "{p:?}"
        );
    }
    // Writers recalled their own writes, facts and skills were checked, successors took
    // over; every one of these checks passed.
    assert_checks_passed(&report, "recall", 30);
    assert_checks_passed(&report, "fact", 3);
    assert_checks_passed(&report, "skill", 1);
    assert_eq!(
        report.latency_ms["visibility"].count,
        report.problems.checks["recall"].passed
    );
    // Every step that ran built its context if its turn came (one step in `context_every` of
    // each identity, from a phase of its own), and every context build was answered. Each
    // identity ran a prefix of its steps, so of its `n` it built n / 3 rounded down or up:
    // over the 12, within 2 builds each of a third of the steps that ran.
    let contexts = report
        .problems
        .attempts
        .get("context")
        .copied()
        .unwrap_or(0);
    let (run, every, slack) = (report.problems.steps_run, 3, 12 * 2);
    assert!(
        contexts * every + slack >= run && contexts * every <= run + slack,
        "{contexts} context builds in {run} steps"
    );
    assert_eq!(report.latency_ms["context"].count, contexts);
    // Who dies and at which step is fixed by the seed; a missed step can take one away.
    assert!(
        report.takeovers + report.problems.missed_steps >= 3,
        "{} takeovers",
        report.takeovers
    );
    assert_eq!(report.invisible(), 0);
    let reference = report.reference.as_ref().expect("raw reference measured");
    assert!(reference.publishes > 0 && reference.replay_events >= verification.stream_events);
    assert!(report.ratios.is_some());
    // Lag and resources were sampled every second, for engram and nats-server.
    assert!(report.timeline.t_secs.len() >= 8);
    assert!(
        report.resources.contains_key("engram") && report.resources.contains_key("nats-server")
    );
    for file in [
        "report.json",
        "report.md",
        "latency.svg",
        "lag.svg",
        "throughput.svg",
        "resources.svg",
    ] {
        let len = std::fs::metadata(out.path().join(file))
            .map(|m| m.len())
            .unwrap_or(0);
        assert!(len > 500, "{file} is {len} bytes");
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("report.json")).unwrap())
            .unwrap();
    assert_eq!(json["verification"]["lost"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chaos_run_kills_a_projector_and_the_server_and_still_loses_nothing() {
    let out = tempfile::tempdir().unwrap();
    // Short on purpose: the projector's outage alone (2 s down, then written-to-readable
    // under its goal for 3 s) runs past the 6 s load from its share (1.8 s), so the faults
    // must hold the load open for the server's kill to be timed under load at all.
    let config = FleetConfig {
        chaos: true,
        ..config(out.path(), 6)
    };
    let report = fleet::run(config, std::future::pending())
        .await
        .expect("the run completes");
    assert!(report.passed(), "{}", report.markdown());
    assert_eq!(
        (report.lost(), report.duplicated(), report.invisible()),
        (0, 0, 0)
    );
    assert!(report.load_secs > 6.0, "{}", report.load_secs);
    assert!(
        report.markdown().contains("held open to"),
        "{}",
        report.markdown()
    );
    // The steps due follow from the load's whole periods, however long the hold was.
    assert_every_step_accounted_for(&report);
    let victims: Vec<&str> = report.chaos.iter().map(|e| e.victim.as_str()).collect();
    assert_eq!(victims, ["vector", "nats-server"]);
    for event in &report.chaos {
        assert!(event.error.is_none(), "{event:?}");
        assert!(event.appends_resumed_secs.is_some(), "{event:?}");
        // Every projector, the restarted one included, went on to apply events appended
        // after the kill: they recovered, not merely kept what they had.
        let (Some(killed_at), Some(caught_up_to)) =
            (event.stream_seq_at_kill, event.caught_up_to_seq)
        else {
            panic!("projectors never caught up after the kill: {event:?}");
        };
        assert!(caught_up_to > killed_at, "{event:?}");
    }
    // A dead projector does not hold up appends: they were acknowledged while it was down.
    assert!(
        report.chaos[0].appends_while_down > 0,
        "{:?}",
        report.chaos[0]
    );
    // Each projector ran in a process of its own and was sampled.
    for name in ["vector", "keyword", "facts", "skills"] {
        assert!(
            report.resources.contains_key(name),
            "{:?}",
            report.resources.keys()
        );
    }
    // The server outage made some requests fail and be retried; none of it leaked into the
    // ledger.
    let v = report.verification.as_ref().unwrap();
    assert!(v.projectors.iter().all(|p| p.digest_matches), "{v:?}");
}

/// `--cluster 3 --nodes 2 --chaos cluster`: under load, a follower NATS node and then the
/// events stream's leader are killed with SIGKILL, then a memory node; every NATS node and
/// then every memory node is restarted in turn; a follower is frozen (SIGSTOP) past its
/// routes' timeout. Nothing acknowledged is lost or counted twice, every read model holds
/// exactly the stream, and each fault's recovery was timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_chaos_run_survives_every_fault_and_loses_nothing() {
    let out = tempfile::tempdir().unwrap();
    let config = FleetConfig {
        cluster: 3,
        nodes: 2,
        chaos_cluster: true,
        // Down for longer than its leases (10 s, taken over within 12.5 s) and the others'
        // catching up on its partitions, so that they are seen to serve them before it is
        // back. On a busy 2-core machine catching up took over 7.5 s (a 20 s restart came
        // first), so there is room for three times that.
        node_restart_after: Duration::from_secs(40),
        // Each fault comes at its share of the load and is timed while the load goes on.
        // Recoveries take 10 to 80 s here (a rolling restart waits out each process's
        // start and catch-up), so the load outlasts the last one with a minute to spare.
        ..config(out.path(), 330)
    };
    // The network partition needs network namespaces (root, iproute2); elsewhere the run
    // says why it left it out.
    let partitionable = engram_natsd::lan::Lan::create(1)
        .map_err(|why| eprintln!("no network partition on this machine: {why}"))
        .is_ok();
    let report = fleet::run(config, std::future::pending())
        .await
        .expect("the run completes");
    assert!(report.passed(), "{}", report.markdown());
    assert_eq!(
        (report.lost(), report.duplicated(), report.invisible()),
        (0, 0, 0)
    );
    let v = report.verification.as_ref().unwrap();
    assert!(v.projectors.iter().all(|p| p.digest_matches), "{v:?}");
    let faults: Vec<&str> = report
        .chaos
        .iter()
        .map(|e| e.action.as_deref().unwrap_or_default())
        .collect();
    let mut expected = vec![
        "kill -9",
        "kill -9",
        "kill -9",
        "rolling restart",
        "sigstop",
    ];
    if partitionable {
        expected.push("partition");
    }
    assert_eq!(faults, expected, "{}", report.markdown());
    for event in &report.chaos {
        assert!(event.error.is_none(), "{event:?}");
        assert!(event.appends_resumed_secs.is_some(), "{event:?}");
        assert!(event.caught_up_secs.is_some(), "{event:?}");
        assert!(event.ack_gap_max_ms.is_some(), "{event:?}");
    }
    let (follower, leader, node) = (&report.chaos[0], &report.chaos[1], &report.chaos[2]);
    // The follower and the leader were NATS nodes, each back with a current replica; the
    // leader's death elected another.
    for nats in [follower, leader] {
        assert!(nats.victim.starts_with("nats-"), "{nats:?}");
        assert!(nats.replica_caught_up_secs.is_some(), "{nats:?}");
    }
    let (before, after) = leader.leader_change.clone().expect("a new leader");
    assert_eq!(before, leader.victim);
    assert_ne!(after, leader.victim);
    assert_eq!(node.victim, "node-1");
    assert!(node.taken_over_secs.is_some(), "{node:?}");
    // The leader cut off: the majority elected another, and the cut-off node caught up
    // after the heal. (What it acknowledged, if anything, is in the ledger checked above.)
    if let Some(cut) = report.chaos.get(5) {
        let (before, after) = cut.leader_change.clone().expect("a new leader");
        assert_eq!(before, cut.victim);
        assert_ne!(after, cut.victim);
        assert!(cut.replica_caught_up_secs.is_some(), "{cut:?}");
    }
    // What three replicas cost, measured in the same run.
    assert!(report.reference_r1.is_some());
}

/// A query service that refuses every retrieve (its `max_top_k` is below what the load test
/// asks for) fails the run: the refusals are errors no retry can fix, and the recalls they
/// refused never got an answer. The ledger itself is clean, so only these checks can fail it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_against_a_query_service_that_refuses_every_retrieve_fails() {
    let out = tempfile::tempdir().unwrap();
    let refusing = out.path().join("refusing.toml");
    std::fs::write(&refusing, "[query]\nmax_top_k = 1\n").unwrap();
    let config = FleetConfig {
        engram_config: Some(refusing),
        churn: 0.0,
        ..config(out.path(), 3)
    };
    let report = fleet::run(config, std::future::pending())
        .await
        .expect("the run completes");
    assert!(!report.passed(), "{}", report.markdown());
    let failures = report.failures().join("; ");
    assert!(
        failures.contains("recall:invalid errors no retry can fix"),
        "{failures}"
    );
    assert!(
        failures.contains("query:invalid errors no retry can fix"),
        "{failures}"
    );
    let recalls = &report.problems.checks["recall"];
    assert!(
        recalls.due > 0 && recalls.unchecked == recalls.due,
        "{recalls:?}"
    );
    assert!(
        failures.contains("read-your-writes checks never answered"),
        "{failures}"
    );
    let v = report.verification.as_ref().expect("verified");
    assert_eq!((v.lost, v.duplicated, v.seq_mismatch), (0, 0, 0));
}

/// A deployment whose query service is down: every retrieve, context and facts request finds
/// no responder. Those are retryable, so they count against the error budget, which they
/// exceed; the recalls retried until the run gave up count as never answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_against_a_deployment_without_a_query_service_fails_on_its_error_budget() {
    let nats = engram_testkit::TestNats::start().await;
    let home = tempfile::tempdir().unwrap();
    // The projectors alone, as their own process: no query service answers.
    let _projectors = spawn_engram(home.path(), &nats.url(), "projector")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let out = tempfile::tempdir().unwrap();
    let config = FleetConfig {
        nats: Some(nats.url()),
        engram_bin: None,
        churn: 0.0,
        drain_limit: Duration::from_secs(10),
        ..config(out.path(), 3)
    };
    let report = fleet::run(config, std::future::pending())
        .await
        .expect("the run completes");
    assert!(!report.passed(), "{}", report.markdown());
    let failures = report.failures().join("; ");
    for operation in ["query", "context"] {
        assert!(
            failures.contains(&format!("{operation}: "))
                && failures.contains("over the error budget"),
            "{operation}: {failures}"
        );
    }
    assert!(
        report.problems.hard_errors.is_empty(),
        "no responders is retryable: {:?}",
        report.problems.hard_errors
    );
    assert!(report.problems.unchecked > 0, "{}", report.markdown());
    let v = report.verification.as_ref().expect("verified");
    assert_eq!((v.lost, v.duplicated, v.seq_mismatch), (0, 0, 0));
    assert!(v.projectors.iter().all(|p| p.digest_matches), "{v:?}");
}

/// `--nats <url>`: the load test drives a deployment it did not start (here `engram up` run
/// by the test against a server of its own) and verifies it the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_against_a_remote_deployment_verifies_it_too() {
    let nats = engram_testkit::TestNats::start().await;
    let home = tempfile::tempdir().unwrap();
    let mut up = spawn_engram(home.path(), &nats.url(), "up")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines =
        tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(up.stdout.take().unwrap()));
    loop {
        let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
            .await
            .expect("engram up starts")
            .unwrap()
            .expect("engram up printed its ready line");
        if line.starts_with("engram is up") {
            break;
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

    // The deployment already holds history, projected, and retention has removed the
    // oldest of it: verification must check the run alone, from where each part stood.
    let bus = nats.bus().await;
    bus.provision().await.unwrap();
    for i in 0..20 {
        let event = with_client_vector(engram_testkit::event(
            "earlier",
            "history",
            &format!("an earlier observation, number {i}"),
        ));
        bus.append(&event, Default::default()).await.unwrap();
    }
    fleet::verify::drain(&bus, Duration::from_secs(60))
        .await
        .expect("the history is projected");
    // Retention removes seqs 1..=10. (The stream refuses purges: a message limit does it.)
    let mut limited = bus.wanted_stream_config();
    limited.max_messages = 10;
    bus.jetstream().update_stream(&limited).await.unwrap();
    bus.jetstream()
        .update_stream(&bus.wanted_stream_config())
        .await
        .unwrap();

    // And other clients keep writing while the run goes on: good events of their own tenant,
    // a message that is no event, and an event on a subject its envelope disagrees with.
    // Every projector dead-letters the last two; none of it is the run's, and none of it may
    // count against the run.
    let neighbours = tokio::spawn({
        let bus = nats.bus().await;
        async move {
            let mut i = 0u64;
            loop {
                let event = with_client_vector(engram_testkit::event(
                    "neighbour",
                    "their-task",
                    &format!("a neighbour's note {i}"),
                ));
                bus.append(&event, Default::default()).await.unwrap();
                let js = bus.jetstream();
                let subject = "engram.evt.neighbour.task.their-task.episodic";
                js.publish(subject, "not an event".into())
                    .await
                    .unwrap()
                    .await
                    .unwrap();
                let forged = engram_testkit::event("someone-else", "their-task", "forged");
                let bytes = bus.codec().encode(&forged).unwrap();
                js.publish(subject, bytes.into())
                    .await
                    .unwrap()
                    .await
                    .unwrap();
                i += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });

    let out = tempfile::tempdir().unwrap();
    let config = FleetConfig {
        nats: Some(nats.url()),
        engram_bin: None,
        churn: 0.2,
        ..config(out.path(), 6)
    };
    let report = fleet::run(config, std::future::pending())
        .await
        .expect("the run completes");
    neighbours.abort();
    assert!(report.passed(), "{}", report.markdown());
    // Retention removed history before the run: a successor's bootstrap completes from a
    // snapshot, or is refused for the gap (never loads it), and none fails otherwise.
    let b = &report.bootstraps;
    assert_eq!(b.failed, 0, "{}", report.markdown());
    assert_eq!(b.completed + b.refused_tail_gone, report.takeovers, "{b:?}");
    // 12 instances at 2 steps/s each for 6 s.
    assert_eq!(report.problems.steps_due, 144);
    assert_every_step_accounted_for(&report);
    let v = report.verification.as_ref().unwrap();
    // The baseline is past the projected history (and whatever the neighbours wrote before
    // the run), for the stream and for every projector, which had applied that history.
    assert!(v.baseline_seq >= 20, "{v:?}");
    for p in &v.projectors {
        assert!(p.baseline_seq >= 20, "{p:?}");
        assert!(
            p.digest_matches && p.applied_events == p.expected_events,
            "{p:?}"
        );
        // The neighbours' refused messages were dead-lettered, and not held against it.
        assert!(p.dead_lettered >= 2, "{p:?}");
    }
    // Nothing of the deployment to sample locally (the load test samples itself only), but
    // lag still is.
    assert_eq!(
        report.resources.keys().collect::<Vec<_>>(),
        ["loadtest"],
        "{:?}",
        report.resources
    );
    assert!(
        report.timeline.lag_events["vector"]
            .iter()
            .any(Option::is_some)
    );
    let _ = up.start_kill();
}
