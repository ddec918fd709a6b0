//! Three instances edit the team's task board at once, one of them offline, and every reader
//! shows the same merged board; two set one field at once, and the conflict keeps both.

use anyhow::Context as _;
use engram_docs::{Conflict, TaskBoard, TaskItem, TaskStatus};
use engram_memory::proto::{DocRead, DocRequest, ScopeRequest};
use engram_schema::{Ident, Scope, ScopeKind};

use super::{Demo, SECTIONS, after};
use crate::output::one_line;

/// The team whose board the demo edits, and the board's name in this run.
pub(super) fn board(demo: &Demo<'_>) -> anyhow::Result<(Scope, String)> {
    Ok((
        Scope::new(ScopeKind::Team, "core")?,
        format!("sprint-{}", demo.run_id),
    ))
}

fn item(title: &str) -> TaskItem {
    TaskItem {
        title: title.into(),
        ..TaskItem::default()
    }
}

pub(super) async fn run(demo: &Demo<'_>) -> anyhow::Result<()> {
    let (team, name) = board(demo)?;
    println!(
        "\n{} three instances edit the team's task board at once (task_board/{name} in {team}) ==",
        SECTIONS[6]
    );
    let (i1, i2, i3) = (
        demo.agent("coder", "i-1")?,
        demo.agent("coder", "i-2")?,
        demo.agent("coder", "i-3")?,
    );
    let mut one = i1.open_doc::<TaskBoard>(team.clone(), &name, None).await?;
    one.edit(|b| {
        b.items.insert("t-1".into(), item("fix the login bug"));
        b.items
            .insert("t-2".into(), item("add a test for quoted passwords"));
    })?;
    let created = one.push().await?.context("the new board was not pushed")?;
    println!(
        "  i-1  creates it with t-1 \"fix the login bug\" and t-2 \"add a test for quoted passwords\"  seq={}",
        created.seq
    );
    // The other two open it as it is now; then i-1 goes offline and edits its own copy.
    let (two, three) = tokio::join!(
        i2.open_doc::<TaskBoard>(team.clone(), &name, Some(created.seq)),
        i3.open_doc::<TaskBoard>(team.clone(), &name, Some(created.seq)),
    );
    let (mut two, mut three) = (two?, three?);
    one.edit(|b| {
        if let Some(t) = b.items.get_mut("t-2") {
            t.owner = Some("i-1".into());
            t.status = TaskStatus::Doing;
        }
        b.items
            .insert("t-3".into(), item("rotate the staging database password"));
    })?;
    println!(
        "  i-1  offline: takes t-2, adds t-3 ({} change(s) kept locally, not sent)",
        one.unsent()
    );
    // i-2 and i-3 both take t-1, neither having seen the other's edit.
    two.edit(|b| {
        if let Some(t) = b.items.get_mut("t-1") {
            t.owner = Some("i-2".into());
            t.status = TaskStatus::Doing;
            t.notes.push("reproduced with the password a'b".into());
        }
    })?;
    three.edit(|b| {
        if let Some(t) = b.items.get_mut("t-1") {
            t.owner = Some("i-3".into());
        }
    })?;
    let (pushed_two, pushed_three) = tokio::join!(two.push(), three.push());
    let (pushed_two, pushed_three) = (
        pushed_two?.context("i-2's edit was not pushed")?,
        pushed_three?.context("i-3's edit was not pushed")?,
    );
    println!(
        "  i-2  sets t-1 owner=\"i-2\", status doing, adds a note   seq={}\n  i-3  sets t-1 owner=\"i-3\" at the same moment               seq={}",
        pushed_two.seq, pushed_three.seq
    );
    let back = one
        .push()
        .await?
        .context("i-1's offline edit was not pushed")?;
    println!(
        "  i-1  back online, pushes its offline edit                  seq={}",
        back.seq
    );
    let last = [created.seq, pushed_two.seq, pushed_three.seq, back.seq]
        .into_iter()
        .max()
        .unwrap_or_default();

    // Four readers: the document service, and each instance's own copy after a refresh.
    let served = demo
        .client
        .doc(&DocRequest {
            scopes: ScopeRequest {
                tenant: demo.tenant.clone(),
                scope: team.clone(),
                grants: Vec::new(),
            },
            read: DocRead::State,
            doc_type: Some(Ident::parse("doc_type", "task_board")?),
            name: Some(Ident::parse("name", name.as_str())?),
            include_bytes: false,
            include_values: false,
            limit: 1,
            consistency: after(last),
        })
        .await?;
    let summary = served
        .doc
        .as_ref()
        .context("the document service has no board")?;
    let mut readers = Vec::new();
    for (who, copy) in [("i-1", &mut one), ("i-2", &mut two), ("i-3", &mut three)] {
        copy.refresh().await?;
        readers.push((who, copy.heads(), copy.value()?, copy.conflicts()));
    }
    let (_, _, board, _) = &readers[0];
    for (who, heads, value, conflicts) in &readers {
        anyhow::ensure!(
            *heads == summary.heads,
            "{who}'s board has heads {heads:?}, the document service's {:?}",
            summary.heads
        );
        anyhow::ensure!(
            value == board && *conflicts == served.conflicts,
            "{who}'s board differs from i-1's: {value:?} ({conflicts:?}) against {board:?} ({:?})",
            served.conflicts
        );
    }
    let served_board: TaskBoard = serde_json::from_value(
        summary
            .value
            .clone()
            .context("the document service sent no value")?,
    )
    .context("the document service's board does not read as a task board")?;
    anyhow::ensure!(
        served_board == *board,
        "the document service's board {served_board:?} differs from the instances' {board:?}"
    );
    // Every edit is in it: i-1's offline ones, i-2's note, and one of the two owners.
    let t1 = board
        .items
        .get("t-1")
        .context("the merged board has no t-1")?;
    let t2 = board
        .items
        .get("t-2")
        .context("the merged board has no t-2")?;
    anyhow::ensure!(
        board.items.contains_key("t-3")
            && t2.owner.as_deref() == Some("i-1")
            && t2.status == TaskStatus::Doing
            && t1.status == TaskStatus::Doing
            && t1.notes == ["reproduced with the password a'b"],
        "the merged board lost an edit: {board:?}"
    );
    let winner = t1.owner.clone().context("t-1 has no owner")?;
    let conflict = owner_conflict(&served.conflicts)?;
    let values: Vec<Option<&str>> = conflict.values.iter().map(|v| v.as_str()).collect();
    let mut both = values.clone();
    both.sort_unstable();
    anyhow::ensure!(
        both == [Some("i-2"), Some("i-3")] && values[0] == Some(winner.as_str()),
        "the conflict on /items/t-1/owner holds {values:?}, the board shows {winner:?}"
    );

    println!(
        "  every reader shows the same board: i-1, i-2, i-3 (after a refresh) and the document service ({} changes, heads {})",
        summary.changes,
        summary
            .heads
            .iter()
            .map(|h| h.chars().take(8).collect::<String>())
            .collect::<Vec<_>>()
            .join(",")
    );
    for (id, t) in &board.items {
        println!(
            "    {id}  {:<6} {:<5} {}{}",
            t.status.as_str(),
            t.owner.as_deref().unwrap_or("-"),
            one_line(&t.title, 45),
            t.notes
                .iter()
                .map(|n| format!("  (note: {n})"))
                .collect::<String>()
        );
    }
    println!(
        "  conflicts: {}  {}  (both kept, the winner first; every replica picks the same one)",
        conflict.path,
        conflict
            .values
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join("  |  ")
    );
    Ok(())
}

/// The one conflict the demo makes: the owner of t-1.
fn owner_conflict(conflicts: &[Conflict]) -> anyhow::Result<&Conflict> {
    match conflicts {
        [one] if one.path == "/items/t-1/owner" => Ok(one),
        other => {
            anyhow::bail!("expected one conflict, on /items/t-1/owner; the board has {other:?}")
        }
    }
}
