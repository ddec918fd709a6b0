//! `engram-bench locomo`: retrieval recall on LoCoMo, through the real bus, projectors and
//! query service.
//!
//! Each conversation becomes one scope (`task:<sample_id>`) of a fresh tenant; each turn one
//! episodic event dated by its session. After ingest, every category 1-4 question is asked in
//! its conversation's scope with the ingest's last sequence as read-your-writes token, once
//! per mode: hybrid (the service's default ranking), hybrid with plain RRF, dense only and
//! BM25 only. Nothing is tuned per question; the same code runs on held-out data.
//!
//! Before those, one dense pass ("dense-cold") embeds every question: its latency is a query
//! embedding plus a dense search, and the modes after it find the embedding cached.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use crate::progress;
use anyhow::Context as _;
use chrono::Duration as ChronoDuration;
use engram::config::Config;
use engram_locomo::{Dataset, DiaId, Evaluator};
use engram_memory::proto::{
    Consistency, Fusion, Ranking, RetrievalMode, RetrieveRequest, ScopeRequest,
};
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_sdk::{Client, RetryPolicy};

#[derive(Debug, clap::Args)]
pub struct LocomoArgs {
    /// The LoCoMo JSON file (e.g. ../shared/bench/locomo-dev.json).
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// Results per question (the largest k reported).
    #[arg(long, default_value_t = 20)]
    pub top_k: usize,
    /// Only the first N conversations (quick runs).
    #[arg(long)]
    pub conversations: Option<usize>,
    /// Also ingest every conversation into a second tenant with each session's end marked,
    /// consolidate it (merge near-duplicates, summarise sessions) and ask every question
    /// there too, as mode `hybrid-consolidated`: consolidation on and off in one run.
    #[arg(long)]
    pub consolidation: bool,
    /// Memory nodes as processes of their own (`engram up --nodes N`, the `engram` binary
    /// beside this one); 0 (the default) runs one in this process. The numbers must not
    /// change with the number of nodes.
    #[arg(long, default_value_t = 0)]
    pub nodes: u16,
}

/// What an ingest stored: the turns each sequence stands for, the last sequence, and each
/// turn's event id with its dia id and text.
struct Ingested {
    dia_of_seq: HashMap<u64, Vec<DiaId>>,
    last_seq: u64,
    turns: HashMap<String, (DiaId, String)>,
}

/// Ingests `conversations` into `tenant`, one scope each; with `session_ends`, a
/// `checkpoint` marked finished follows each session's turns.
async fn ingest(
    client: &Client,
    tenant: &Ident,
    agent: &Ident,
    conversations: &[&engram_locomo::Conversation],
    session_ends: bool,
) -> anyhow::Result<Ingested> {
    let turns: usize = conversations.iter().map(|c| c.turn_count()).sum();
    let bar = progress(turns as u64, "ingesting turns");
    let mut out = Ingested {
        dia_of_seq: HashMap::new(),
        last_seq: 0,
        turns: HashMap::new(),
    };
    let ingest_started = Instant::now();
    for conv in conversations {
        let scope = Scope::new(ScopeKind::Task, &conv.sample_id)?;
        let mut events = Vec::new();
        let mut dias = Vec::new();
        let mut session_of_last: Option<u32> = None;
        let end_of = |at: chrono::DateTime<chrono::Utc>| {
            let mut end = Envelope::new(
                tenant.clone(),
                scope.clone(),
                agent.clone(),
                agent.clone(),
                Layer::Working,
                EventKind::Checkpoint,
                Content {
                    text: "session over".into(),
                    data: Some(serde_json::json!({"finished": true})),
                },
            );
            end.occurred_at = at;
            end
        };
        let mut last_at = None;
        for (session, turn) in conv.turns() {
            if session_ends
                && session_of_last.is_some_and(|s| s != turn.dia_id.session)
                && let Some(at) = last_at
            {
                events.push(end_of(at));
                dias.push(None);
            }
            session_of_last = Some(turn.dia_id.session);
            let mut event = Envelope::new(
                tenant.clone(),
                scope.clone(),
                agent.clone(),
                agent.clone(),
                Layer::Episodic,
                EventKind::Observation,
                Content::text(turn.memory_text()),
            );
            // Turns of one session keep their order within the session's date.
            event.occurred_at = session.date + ChronoDuration::seconds(turn.dia_id.turn.into());
            last_at = Some(event.occurred_at);
            out.turns.insert(
                event.event_id.to_string(),
                (turn.dia_id, event.content.text.clone()),
            );
            events.push(event);
            dias.push(Some(turn.dia_id));
        }
        if session_ends && let Some(at) = last_at {
            events.push(end_of(at));
            dias.push(None);
        }
        for (chunk, dia_chunk) in events.chunks(256).zip(dias.chunks(256)) {
            let receipts = client.append_batch(chunk).await;
            for (receipt, dia) in receipts.into_iter().zip(dia_chunk) {
                let receipt = receipt?;
                out.last_seq = out.last_seq.max(receipt.seq);
                if let Some(dia) = dia {
                    out.dia_of_seq.insert(receipt.seq, vec![*dia]);
                    bar.inc(1);
                }
            }
        }
    }
    bar.finish_and_clear();
    eprintln!(
        "ingested {turns} turns into {tenant} in {:.1}s; waiting for projection",
        ingest_started.elapsed().as_secs_f64()
    );
    Ok(out)
}

/// Consolidates every conversation of `tenant` (dedup and session summaries; decay stays
/// off, as the questions are about everything ever said and nothing reports use) and maps
/// each output to the turns it stands for: a summary to those whose sentences it quotes, a
/// merged memory to its representative. Returns the last output's sequence.
async fn consolidate(
    client: &Client,
    tenant: &Ident,
    conversations: &[&engram_locomo::Conversation],
    ingested: &Ingested,
    dia_of_seq: &mut HashMap<u64, Vec<DiaId>>,
) -> anyhow::Result<u64> {
    let started = Instant::now();
    let (mut summaries, mut merged, mut last) = (0, 0, ingested.last_seq);
    for conv in conversations {
        let request = engram_memory::proto::ConsolidateRequest {
            scopes: ScopeRequest {
                tenant: tenant.clone(),
                scope: Scope::new(ScopeKind::Task, &conv.sample_id)?,
                grants: Vec::new(),
            },
            steps: vec!["dedup".into(), "summarise".into()],
            restore: Vec::new(),
            apply: false,
            consistency: Consistency {
                min_seq: Some(ingested.last_seq),
                wait_ms: Some(engram_memory::proto::limits::MAX_WAIT_MS),
            },
        };
        let (events, receipts) = client.consolidate(&request).await?;
        for (event, receipt) in events.iter().zip(receipts) {
            let seq = receipt?.seq;
            last = last.max(seq);
            if event.kind != EventKind::Consolidated {
                continue;
            }
            let data = event.content.data.as_ref();
            let sources: Vec<&str> = data
                .and_then(|d| d["sources"].as_array())
                .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
                .unwrap_or_default();
            let dias: Vec<DiaId> = match data.and_then(|d| d["op"].as_str()) {
                Some("summary") => {
                    summaries += 1;
                    sources
                        .iter()
                        .filter_map(|id| ingested.turns.get(*id))
                        .filter(|(_, text)| {
                            engram_consolidate::summary::sentences(text)
                                .iter()
                                .any(|s| event.content.text.contains(s.as_str()))
                        })
                        .map(|(dia, _)| *dia)
                        .collect()
                }
                _ => {
                    merged += 1;
                    event
                        .causation_id
                        .as_ref()
                        .and_then(|id| ingested.turns.get(id.as_str()))
                        .map(|(dia, _)| vec![*dia])
                        .unwrap_or_default()
                }
            };
            dia_of_seq.insert(seq, dias);
        }
    }
    eprintln!(
        "consolidated {tenant}: {summaries} session summaries, {merged} merged memories, in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(last)
}

/// The modes compared, with the ranking each uses (`None`: the service's configured default).
fn modes(default: &Ranking) -> Vec<(&'static str, RetrievalMode, Option<Ranking>)> {
    vec![
        ("hybrid", RetrievalMode::Hybrid, Some(default.clone())),
        (
            "hybrid-rrf",
            RetrievalMode::Hybrid,
            Some(Ranking {
                fusion: Fusion::Rrf,
                keyword_weight: 0.5,
                ..default.clone()
            }),
        ),
        ("dense", RetrievalMode::Dense, None),
        ("bm25", RetrievalMode::Keyword, None),
    ]
}

pub async fn run(config: &Config, args: LocomoArgs, json: bool) -> anyhow::Result<ExitCode> {
    let dataset = Dataset::load(&args.data)?;
    let counts = dataset.counts();
    eprintln!(
        "locomo: {} conversations, {} turns, {} questions to ask ({} skipped without evidence, {} unmatched evidence ids)",
        counts.conversations,
        counts.turns,
        counts.questions_asked,
        counts.questions_skipped_no_evidence,
        counts.unmatched_evidence
    );

    // Self-contained unless --nats was given: a managed server and every service, in a
    // temporary home that is removed afterwards.
    let mut temp_home = None;
    let mut running = None;
    let client = if config.nats.url.is_some() {
        Client::from_bus(
            engram_bus::Bus::connect(config.bus_config(config.client_url())).await?,
            RetryPolicy::default(),
        )
    } else {
        let (home, mut local) = crate::temporary_home(config)?;
        eprintln!("starting an embedded engram in {}", home.path().display());
        if args.nodes > 0 {
            local.origin.node_bin = Some(crate::engram_bin_beside()?);
        }
        let up = engram::up::start(&local, usize::from(args.nodes)).await?;
        let client = Client::from_bus(up.bus.clone(), RetryPolicy::default());
        temp_home = Some(home);
        running = Some(up);
        client
    };
    let ranking = config.query.ranking.clone();
    let result = bench(&client, &dataset, &args, &ranking).await;
    if let Some(up) = running {
        up.shutdown().await;
    }
    drop(temp_home);
    let evaluator = result?.with_dataset(counts);
    let report = evaluator.report();
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    Ok(ExitCode::SUCCESS)
}

async fn bench(
    client: &Client,
    dataset: &Dataset,
    args: &LocomoArgs,
    ranking: &Ranking,
) -> anyhow::Result<Evaluator> {
    // A fresh tenant per run: repeated runs against one server never see each other's data.
    let tenant = Ident::parse("tenant", format!("locomo-{}", &uuid_hex()[..12]))?;
    let agent = Ident::parse("agent", "locomo")?;
    let conversations: Vec<_> = dataset
        .conversations()
        .iter()
        .take(args.conversations.unwrap_or(usize::MAX))
        .collect();

    let mut ingested = ingest(client, &tenant, &agent, &conversations, false).await?;
    let last_seq = ingested.last_seq;
    // The same conversations again, in a tenant of their own, with each session's end marked
    // and every conversation consolidated (merged duplicates, session summaries): the
    // consolidation pass asks there, in the same run.
    let consolidated = if args.consolidation {
        let tenant = Ident::parse("tenant", format!("{tenant}-c"))?;
        let with_ends = ingest(client, &tenant, &agent, &conversations, true).await?;
        ingested.dia_of_seq.extend(with_ends.dia_of_seq.clone());
        let done = consolidate(
            client,
            &tenant,
            &conversations,
            &with_ends,
            &mut ingested.dia_of_seq,
        )
        .await?;
        Some((tenant, done))
    } else {
        None
    };
    let dia_of_seq = ingested.dia_of_seq;

    // The first pass embeds every question (dense only, "dense-cold"); the embedding cache
    // then holds them, so the timed modes after it compare retrieval, not who embedded first.
    // Without it, whichever mode asked first would carry a model forward pass per query.
    let mut passes = vec![vec![("dense-cold", RetrievalMode::Dense, None)]];
    passes.push(modes(ranking));
    // Which tenant each pass asks in, and the token it waits for.
    let mut asked_in = vec![(tenant.clone(), last_seq); passes.len()];
    if let Some((tenant_c, done)) = &consolidated {
        passes.push(vec![
            (
                "hybrid-consolidated",
                RetrievalMode::Hybrid,
                Some(ranking.clone()),
            ),
            // Diagnostic: summaries competing with the turns for the top k places.
            (
                "hybrid-consolidated-competing",
                RetrievalMode::Hybrid,
                Some(Ranking {
                    summary_results: true,
                    ..ranking.clone()
                }),
            ),
        ]);
        asked_in.push((tenant_c.clone(), *done));
    }
    let asked: usize = conversations
        .iter()
        .map(|c| c.questions.iter().filter(|q| q.is_asked()).count())
        .sum();
    let per_question: usize = passes.iter().map(Vec::len).sum();
    let bar = progress((asked * per_question) as u64, "asking questions");
    let mut evaluator = Evaluator::default();
    let mut breakdown = Breakdown::default();
    let mut first = true;
    let mut waited_for = None;
    for (modes, (tenant, last_seq)) in passes.iter().zip(&asked_in) {
        let last_seq = *last_seq;
        // A pass with a token of its own waits for it on its first query, as the first pass
        // waits for the ingest.
        if waited_for != Some((tenant.clone(), last_seq)) {
            first = true;
            waited_for = Some((tenant.clone(), last_seq));
        }
        for conv in &conversations {
            let scopes = ScopeRequest {
                tenant: tenant.clone(),
                scope: Scope::new(ScopeKind::Task, &conv.sample_id)?,
                grants: Vec::new(),
            };
            for question in conv.questions.iter().filter(|q| q.is_asked()) {
                for (mode_name, mode, mode_ranking) in modes {
                    let request = RetrieveRequest {
                        scopes: scopes.clone(),
                        query: question.question.clone(),
                        vector: None,
                        top_k: args.top_k,
                        filter: Default::default(),
                        consistency: Consistency {
                            min_seq: Some(last_seq),
                            wait_ms: Some(5_000),
                        },
                        mode: *mode,
                        ranking: mode_ranking.clone(),
                    };
                    let before = Timers::read();
                    let started = Instant::now();
                    let response = if first {
                        // The first query waits for the whole ingest to be embedded.
                        crate::retrieve_when_visible(client, request, Duration::from_secs(3600))
                            .await?
                    } else {
                        client
                            .retrieve(&request)
                            .await
                            .with_context(|| format!("retrieving for {:?}", question.question))?
                    };
                    let latency = if first {
                        // The first query includes the wait for projection; not a query
                        // latency.
                        first = false;
                        Duration::ZERO
                    } else {
                        started.elapsed()
                    };
                    // A summary stands for the turns it quotes, each new one taking a place
                    // of the top k, so a summary is never worth more than the turns it
                    // holds; a turn it quotes that a better-ranked result already showed
                    // is not shown again, and takes no second place.
                    let mut shown = std::collections::HashSet::new();
                    let ranked: Vec<DiaId> = response
                        .results
                        .iter()
                        .filter_map(|r| dia_of_seq.get(&r.seq))
                        .flatten()
                        .copied()
                        .filter(|dia| shown.insert(*dia))
                        .collect();
                    if !latency.is_zero() {
                        breakdown.add(mode_name, latency, Timers::read().since(&before));
                    }
                    evaluator.record(mode_name, question, &ranked, latency);
                    bar.inc(1);
                }
            }
        }
    }
    bar.finish_and_clear();
    breakdown.print();
    Ok(evaluator)
}

/// Cumulative seconds of the service's own timers, read around each query: the benchmark
/// asks one question at a time, so the difference is that query's share. Only the embedded
/// services (no --nats) report into this process.
#[derive(Clone, Copy, Default)]
struct Timers([f64; 6]);

impl Timers {
    const NAMES: [&'static str; 6] = [
        "service",
        "to vector",
        "to keyword",
        "fuse",
        "vector handler",
        "keyword handler",
    ];

    fn read() -> Self {
        use engram_telemetry::metrics::{QUERY_SECONDS, RETRIEVE_STAGE_SECONDS};
        let op = |name: &str| QUERY_SECONDS.with_label_values(&[name]).get_sample_sum();
        let stage = |name: &str| {
            RETRIEVE_STAGE_SECONDS
                .with_label_values(&[name])
                .get_sample_sum()
        };
        Self([
            op("retrieve"),
            stage("vector"),
            stage("keyword"),
            stage("fuse"),
            op("vector_search"),
            op("keyword_search"),
        ])
    }

    fn since(&self, before: &Self) -> Self {
        let mut d = Self::default();
        for (i, v) in d.0.iter_mut().enumerate() {
            *v = self.0[i] - before.0[i];
        }
        d
    }
}

/// Where each mode's query time goes, in mean milliseconds.
#[derive(Default)]
struct Breakdown(Vec<(&'static str, usize, f64, Timers)>);

impl Breakdown {
    fn add(&mut self, mode: &'static str, latency: Duration, timers: Timers) {
        let at = match self.0.iter().position(|(m, ..)| *m == mode) {
            Some(at) => at,
            None => {
                self.0.push((mode, 0, 0.0, Timers::default()));
                self.0.len() - 1
            }
        };
        let (_, count, total, sums) = &mut self.0[at];
        *count += 1;
        *total += latency.as_secs_f64();
        for (sum, v) in sums.0.iter_mut().zip(timers.0) {
            *sum += v;
        }
    }

    fn print(&self) {
        if self.0.iter().all(|(_, _, _, t)| t.0[0] == 0.0) {
            return;
        }
        eprintln!(
            "where the time goes (mean ms per query; `to X` is the request to projector X as the query service waits for it, `X handler` the time X spends answering):"
        );
        let mut header = format!("{:<12} {:>8}", "mode", "client");
        for name in Timers::NAMES {
            header.push_str(&format!(" {name:>15}"));
        }
        eprintln!("{header}");
        for (mode, count, total, sums) in &self.0 {
            let n = *count as f64;
            let mut line = format!("{mode:<12} {:>8.3}", total * 1e3 / n);
            for v in sums.0 {
                line.push_str(&format!(" {:>15.3}", v * 1e3 / n));
            }
            eprintln!("{line}");
        }
    }
}

fn uuid_hex() -> String {
    engram_schema::EventId::new()
        .to_string()
        .chars()
        .rev()
        .filter(char::is_ascii_alphanumeric)
        .collect()
}
