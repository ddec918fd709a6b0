//! `build_context`: the memory an agent sees at the start of a step.
//!
//! Five sources, fetched in parallel: working memory of the task (and of the own scope),
//! the open items of the task boards of the readable scopes, skills matching the task,
//! current facts matching the query, and hybrid retrieval of episodic and semantic memories
//! (without those below `query.context_min_confidence`, 0.3: memories later outcomes
//! contradicted twice, or a faulty instance wrote). Items are deduplicated by normalised
//! text and packed greedily by section priority
//! (working, task board, procedural, facts, session summaries, memories), each section capped
//! at a share of the budget so that one source cannot crowd out the rest; what the caps leave
//! unused goes to whatever did not fit. The rendered text is counted with the model's
//! tokenizer and never exceeds the budget.

use std::collections::HashSet;

use engram_bus::EntryBounds;
use engram_memory::MemoryFilter;
use engram_memory::proto::{
    Context, ContextItem, ContextRequest, DocRead, DocRequest, ErrorCode, FactsRequest,
    RetrievalMode, RetrieveRequest, SkillsRequest,
};
use engram_rpc::Failure;
use engram_schema::{Layer, Scope, ScopeKind};

use crate::{Query, unavailable};

/// Share of the budget each section may take in the first pass.
const CAPS: [(Section, f32); 6] = [
    (Section::Working, 0.25),
    (Section::Board, 0.2),
    (Section::Skills, 0.2),
    (Section::Facts, 0.2),
    (Section::Summaries, 0.2),
    (Section::Memories, 1.0),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Section {
    Working,
    Board,
    Skills,
    Facts,
    Summaries,
    Memories,
}

impl Section {
    fn title(self) -> &'static str {
        match self {
            Self::Working => "working memory",
            Self::Board => "task board",
            Self::Skills => "skills",
            Self::Facts => "facts",
            Self::Summaries => "session summaries",
            Self::Memories => "memories",
        }
    }
}

#[derive(Clone)]
struct Candidate {
    section: Section,
    item: ContextItem,
}

/// The most bytes of one candidate that are tokenised: about 16 bytes per token of the
/// budget, never more than 16 KiB. A WordPiece token rarely spans more than a word, so what
/// is cut could not have fitted; the final count on the rendered text keeps the budget exact.
fn item_cap(token_budget: usize) -> usize {
    token_budget.saturating_mul(16).min(16 * 1024)
}

/// `text` cut to at most `max` bytes, on a character boundary.
fn truncate_bytes(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

pub(crate) async fn build(q: &Query, request: ContextRequest) -> Result<Context, Failure> {
    let scopes = request.scopes.resolve().map_err(Failure::invalid)?;
    request.validate().map_err(Failure::from)?;
    q.check_visible_token(&request.consistency).await?;
    let task_scope = Scope::new(ScopeKind::Task, &request.task)
        .map_err(|e| Failure::invalid(format!("task: {e}")))?;
    // The task's working memory is readable only if the task scope is the own scope or granted.
    let readable: Vec<Scope> = scopes.iter().map(|k| k.scope()).collect();
    let consistency = request.consistency;

    let working = async {
        let wm = q.bus().working_memory().await.map_err(unavailable)?;
        let mut entries = Vec::new();
        let mut wanted = vec![request.scopes.scope.clone()];
        if task_scope != request.scopes.scope && readable.contains(&task_scope) {
            wanted.push(task_scope.clone());
        }
        let mut left_out = 0;
        for scope in wanted {
            let read = wm
                .entries(&request.scopes.tenant, &scope, EntryBounds::default())
                .await
                .map_err(unavailable)?;
            left_out += read.left_out;
            for (key, value) in read.items {
                entries.push((
                    format!("{scope}/{key}"),
                    String::from_utf8_lossy(&value).into_owned(),
                ));
            }
        }
        Ok::<_, Failure>((entries, left_out))
    };
    let boards = q.doc(DocRequest {
        scopes: request.scopes.clone(),
        read: DocRead::List,
        doc_type: Some(
            engram_schema::Ident::parse("doc_type", BOARD_TYPE)
                .map_err(|e| Failure::new(ErrorCode::Internal, e.to_string()))?,
        ),
        name: None,
        include_bytes: false,
        include_values: true,
        limit: MAX_BOARDS,
        consistency,
    });
    let skills = q.skills(SkillsRequest {
        scopes: request.scopes.clone(),
        task: Some(format!("{} {}", request.task, request.query)),
        name: None,
        limit: 3,
        consistency,
    });
    let facts = q.facts(FactsRequest {
        scopes: request.scopes.clone(),
        subject: None,
        predicate: None,
        text: Some(request.query.clone()),
        valid_at: None,
        known_at: None,
        history: false,
        limit: 10,
        consistency,
    });
    let memories = q.retrieve(RetrieveRequest {
        scopes: request.scopes.clone(),
        query: request.query.clone(),
        vector: request.vector.clone(),
        top_k: 20,
        // A context is what a model reads: no memory the log has come to distrust.
        filter: MemoryFilter {
            min_confidence: Some(q.config.context_min_confidence).filter(|m| *m > 0.0),
            ..MemoryFilter::default()
        },
        consistency,
        mode: RetrievalMode::Hybrid,
        ranking: None,
    });
    let (working, boards, skills, facts, memories) =
        tokio::join!(working, boards, skills, facts, memories);

    let cap = item_cap(request.token_budget);
    let mut candidates = Vec::new();
    let mut push = |section: Section, layer: Layer, text: String, source: String, score: f32| {
        candidates.push(Candidate {
            section,
            item: ContextItem {
                layer,
                text: truncate_bytes(text, cap),
                tokens: 0,
                source: truncate_bytes(source, 256),
                score,
            },
        });
    };
    let (working, working_left_out) = working?;
    for (key, value) in working {
        push(
            Section::Working,
            Layer::Working,
            format!("{key}: {value}"),
            key,
            1.0,
        );
    }
    for board in boards?.docs {
        for (text, source) in board_lines(&board) {
            push(Section::Board, Layer::Working, text, source, 1.0);
        }
    }
    for skill in skills?.skills {
        let name = skill["name"].as_str().unwrap_or_default().to_owned();
        let description = skill["description"].as_str().unwrap_or_default();
        let steps: Vec<&str> = skill["steps"]
            .as_array()
            .map(|s| s.iter().filter_map(|x| x.as_str()).collect())
            .unwrap_or_default();
        let mut text = format!("{name}: {description}");
        if !steps.is_empty() {
            text.push_str(&format!(" steps: {}", steps.join("; ")));
        }
        let score = skill["score"].as_f64().unwrap_or(0.0) as f32;
        push(
            Section::Skills,
            Layer::Procedural,
            text,
            format!("skill {name}"),
            score,
        );
    }
    for fact in facts?.facts {
        let text = format!(
            "{} {} {}",
            fact["subject"].as_str().unwrap_or_default(),
            fact["predicate"].as_str().unwrap_or_default(),
            match &fact["object"] {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            }
        );
        let source = fact["sources"][0]["provenance"]["event_id"]
            .as_str()
            .map_or_else(|| "fact".to_owned(), |id| format!("fact from {id}"));
        push(Section::Facts, Layer::Semantic, text, source, 1.0);
    }
    let memories = memories?;
    // The memories' scopes, by the item source they get: what is returned is counted as
    // retrieval usage under each memory's own scope.
    let memory_scopes: std::collections::HashMap<String, _> = memories
        .summaries
        .iter()
        .chain(&memories.results)
        .map(|m| {
            let scope = engram_memory::ScopeKey::new(m.tenant.clone(), m.scope.clone());
            (m.event_id.to_string(), (scope, m.event_id.clone()))
        })
        .collect();
    for summary in memories.summaries {
        push(
            Section::Summaries,
            summary.layer,
            summary.text,
            summary.event_id.to_string(),
            summary.score,
        );
    }
    for memory in memories.results {
        push(
            Section::Memories,
            memory.layer,
            memory.text,
            memory.event_id.to_string(),
            memory.score,
        );
    }
    // Tokenising is CPU work of up to a few milliseconds per item: on the runtime's threads it
    // would stall every other request (and /healthz) behind it.
    let tokens = q.tokens().clone();
    let budget = request.token_budget;
    let mut context = tokio::task::spawn_blocking(move || {
        for c in &mut candidates {
            c.item.tokens = tokens.count(&c.item.text);
        }
        pack(&tokens, candidates, budget)
    })
    .await
    .map_err(|e| Failure::new(ErrorCode::Internal, format!("context packing failed: {e}")))?;
    context.dropped += working_left_out;
    q.usage().count(
        context
            .items
            .iter()
            .filter_map(|item| memory_scopes.get(&item.source))
            .map(|(scope, id)| (scope.clone(), id)),
    );
    Ok(context)
}

/// The document type whose items the context shows.
const BOARD_TYPE: &str = "task_board";
/// Most task boards one context reads.
const MAX_BOARDS: usize = 4;

/// A board's items that are not done, one line each: status, title, owner, latest note.
/// Read from the JSON view, so a board written by a newer client with more fields still
/// shows; a field holding something unexpected reads as absent.
fn board_lines(board: &engram_memory::proto::DocSummary) -> Vec<(String, String)> {
    let Some(items) = board
        .value
        .as_ref()
        .and_then(|v| v.get("items"))
        .and_then(|v| v.as_object())
    else {
        return Vec::new();
    };
    let mut lines = Vec::new();
    for (id, item) in items {
        let field = |name: &str| item.get(name).and_then(|v| v.as_str()).unwrap_or_default();
        let status = field("status");
        if status == "done" {
            continue;
        }
        let mut text = format!(
            "[{}] {}",
            if status.is_empty() { "todo" } else { status },
            field("title")
        );
        let owner = field("owner");
        if !owner.is_empty() {
            text.push_str(&format!(" (owner {owner})"));
        }
        if let Some(note) = item
            .get("notes")
            .and_then(|n| n.as_array())
            .and_then(|n| n.last())
            .and_then(|n| n.as_str())
        {
            text.push_str(&format!(": {note}"));
        }
        lines.push((text, format!("{}/{}#{id}", board.scope, board.name)));
    }
    lines
}

fn normalise(text: &str) -> String {
    text.split_whitespace()
        .map(str::to_lowercase)
        .collect::<Vec<_>>()
        .join(" ")
}

fn pack(tokens: &engram_embed::TokenCounter, candidates: Vec<Candidate>, budget: usize) -> Context {
    let total = candidates.len();
    let mut seen = HashSet::new();
    let mut unique: Vec<Candidate> = candidates
        .into_iter()
        .filter(|c| seen.insert(normalise(&c.item.text)))
        .collect();
    // Headers and bullets cost tokens too: reserve them up front (about 6 per section and
    // 2 per item), then verify on the rendered text.
    let overhead = |items: usize| 6 * 4 + 2 * items;
    let mut chosen: Vec<Candidate> = Vec::new();
    let mut used = 0usize;
    for pass in 0..2 {
        for (section, cap) in CAPS {
            let cap = if pass == 0 {
                (budget as f32 * cap) as usize
            } else {
                budget
            };
            let mut section_used: usize = chosen
                .iter()
                .filter(|c| c.section == section)
                .map(|c| c.item.tokens)
                .sum();
            let mut i = 0;
            while i < unique.len() {
                let c = &unique[i];
                let fits = used + c.item.tokens + overhead(chosen.len() + 1) <= budget
                    && section_used + c.item.tokens <= cap;
                if c.section == section && fits {
                    used += c.item.tokens;
                    section_used += c.item.tokens;
                    chosen.push(unique.remove(i));
                } else {
                    i += 1;
                }
            }
        }
    }
    chosen.sort_by_key(|c| CAPS.iter().position(|(s, _)| *s == c.section));
    let (chosen, rendered, count) = fit_rendering(tokens, chosen, budget);
    let items: Vec<ContextItem> = chosen.into_iter().map(|c| c.item).collect();
    Context {
        dropped: total - items.len(),
        items,
        tokens: count,
        token_budget: budget,
        rendered,
    }
}

/// Keeps the longest prefix of `chosen` (in priority order) whose rendering fits `budget`
/// in the tokenizer's count, dropping the lowest-priority items. Returns the items kept,
/// their rendering and its tokens.
fn fit_rendering(
    tokens: &engram_embed::TokenCounter,
    chosen: Vec<Candidate>,
    budget: usize,
) -> (Vec<Candidate>, String, usize) {
    if tokens.is_additive() {
        fit_by_parts(tokens, chosen, budget)
    } else {
        fit_by_halving(tokens, chosen, budget)
    }
}

/// [`fit_rendering`] for a tokenizer whose counts add up over whitespace: the rendering's
/// count is its parts' (headers, bullets, items), each counted once and cached. Tokenising
/// the whole context again on every build cost more CPU than anything else in it (18% of
/// the service's at 700 appends/s in the load test).
fn fit_by_parts(
    tokens: &engram_embed::TokenCounter,
    mut chosen: Vec<Candidate>,
    budget: usize,
) -> (Vec<Candidate>, String, usize) {
    let bullet = tokens.count("-");
    let (mut count, mut fits, mut current) = (0, 0, None);
    for c in &chosen {
        let mut adds = bullet + tokens.count(&c.item.text);
        if current != Some(c.section) {
            adds += tokens.count(&header(c.section));
            current = Some(c.section);
        }
        if count + adds > budget {
            break;
        }
        count += adds;
        fits += 1;
    }
    chosen.truncate(fits);
    let rendered = render(&chosen);
    (chosen, rendered, count)
}

/// [`fit_rendering`] for any tokenizer: the rendering itself is counted, and the longest
/// prefix that fits is found by halving (a rendering's tokens grow with the prefix), so a few
/// tokenizations rather than one per dropped item.
fn fit_by_halving(
    tokens: &engram_embed::TokenCounter,
    mut chosen: Vec<Candidate>,
    budget: usize,
) -> (Vec<Candidate>, String, usize) {
    // Each rendering is new text, so it bypasses the count cache rather than evict from it.
    let rendered = render(&chosen);
    let count = tokens.count_uncached(&rendered);
    if count <= budget || chosen.is_empty() {
        return (chosen, rendered, count);
    }
    // The empty rendering counts as it does; the whole does not fit.
    let (mut fits, mut over) = (0, chosen.len());
    let (mut fit_text, mut fit_count) = (String::new(), tokens.count_uncached(""));
    while over - fits > 1 {
        let mid = fits + (over - fits) / 2;
        let text = render(&chosen[..mid]);
        let n = tokens.count_uncached(&text);
        if n <= budget {
            (fits, fit_text, fit_count) = (mid, text, n);
        } else {
            over = mid;
        }
    }
    chosen.truncate(fits);
    (chosen, fit_text, fit_count)
}

fn header(section: Section) -> String {
    format!("## {}", section.title())
}

fn render(chosen: &[Candidate]) -> String {
    let mut out = String::new();
    let mut current: Option<Section> = None;
    for c in chosen {
        if current != Some(c.section) {
            if current.is_some() {
                out.push('\n');
            }
            out.push_str(&header(c.section));
            out.push('\n');
            current = Some(c.section);
        }
        out.push_str("- ");
        out.push_str(&c.item.text);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rendering_keeps_the_longest_prefix_that_fits_as_dropping_one_by_one_finds() {
        let tokens = engram_embed::TokenCounter::load_default().unwrap();
        let sections = [Section::Working, Section::Facts, Section::Memories];
        let candidate = |i: usize| Candidate {
            section: sections[i % 3],
            item: ContextItem {
                layer: Layer::Episodic,
                // What the greedy pass estimated; the rendering adds headers and bullets.
                tokens: 1,
                source: format!("s{i}"),
                score: 1.0,
                text: format!("item {i} {}", "word ".repeat(i % 7 + 1)),
            },
        };
        for budget in [0, 1, 5, 17, 40, 90, 200, 10_000] {
            for n in [0, 1, 2, 7, 40] {
                let mut chosen: Vec<Candidate> = (0..n).map(candidate).collect();
                chosen.sort_by_key(|c| CAPS.iter().position(|(s, _)| *s == c.section));
                let expected = one_by_one(&tokens, &chosen, budget);
                for fit in [fit_by_parts, fit_by_halving] {
                    let (kept, rendered, count) = fit(&tokens, chosen.clone(), budget);
                    assert_eq!((kept.len(), count), expected, "budget {budget}, {n} items");
                    assert_eq!(count, tokens.count_uncached(&rendered));
                    assert!(count <= budget || kept.is_empty());
                }
            }
        }
    }

    /// What `pack` did before it halved: drop the last item until the rendering fits.
    fn one_by_one(
        tokens: &engram_embed::TokenCounter,
        sorted: &[Candidate],
        budget: usize,
    ) -> (usize, usize) {
        let mut n = sorted.len();
        let mut count = tokens.count_uncached(&render(&sorted[..n]));
        while count > budget && n > 0 {
            n -= 1;
            count = tokens.count_uncached(&render(&sorted[..n]));
        }
        (n, count)
    }
}
