//! Bootstrap slices of scopes in several partitions: each partition's instance slices its
//! own snapshot, cut at its own sequence; the answer is one slice, their union, with how
//! far each scope is held ([`proto::BootstrapResponse::held`]), so that the reader replays
//! each scope from where its own slice stopped and applies no event twice.

use base64::Engine as _;
use engram_docs::DocStore;
use engram_facts::FactTable;
use engram_memory::ScopeKey;
use engram_memory::model::Sliced;
use engram_memory::proto::{self, BootstrapResponse, ErrorCode, ScopeHeld, read_models};
use engram_projection_runtime::{ApplyLedger, snapshot};
use engram_rpc::Failure;
use engram_skills::SkillRegistry;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// One answer of partitions' bootstrap answers for `scopes` (in the request's order).
pub(crate) fn merge(
    partitions: u32,
    scopes: &[ScopeKey],
    parts: Vec<BootstrapResponse>,
) -> Result<BootstrapResponse, Failure> {
    if parts.len() <= 1 {
        return parts
            .into_iter()
            .next()
            .ok_or_else(|| Failure::new(ErrorCode::Internal, "no partition was asked"));
    }
    let model = parts[0].model.clone();
    match model.as_str() {
        read_models::FACTS => union::<FactTable>(partitions, scopes, parts),
        read_models::SKILLS => union::<SkillRegistry>(partitions, scopes, parts),
        read_models::DOCS => union::<DocStore>(partitions, scopes, parts),
        other => Err(Failure::invalid(format!(
            "{other} keeps no scope snapshots"
        ))),
    }
}

fn union<M>(
    partitions: u32,
    scopes: &[ScopeKey],
    parts: Vec<BootstrapResponse>,
) -> Result<BootstrapResponse, Failure>
where
    M: Sliced + Default + Serialize + DeserializeOwned,
{
    let model = parts[0].model.clone();
    let internal = |e: String| Failure::new(ErrorCode::Internal, e);
    let mut merged: Option<(ApplyLedger, M)> = None;
    let mut held = Vec::new();
    let mut skipped = Vec::new();
    let mut newest: Option<proto::BootstrapSnapshot> = None;
    for part in parts {
        skipped.extend(part.skipped);
        // A partition with no snapshot holds its scopes through nothing: replayed whole.
        let (ledger, slice) = match &part.bytes {
            None => (ApplyLedger::default(), M::default()),
            Some(b64) => {
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|e| internal(e.to_string()))?;
                snapshot::decode::<M>(&bytes, "a partition's slice", model.as_str())
                    .map_err(|e| internal(e.to_string()))?
            }
        };
        held.push(ledger.seq);
        // The set's version is its newest cut: asked for again as a version, each
        // partition gives its newest snapshot at or below it, the same ones.
        if let Some(s) = part.snapshot
            && newest.as_ref().is_none_or(|o| s.version > o.version)
        {
            newest = Some(s);
        }
        merged = Some(match merged {
            None => (ledger, slice),
            Some((mut all, mut union)) => {
                union.absorb(slice);
                all.seq = all.seq.min(ledger.seq);
                all.events += ledger.events;
                all.digest = all.digest.wrapping_add(ledger.digest);
                (all, union)
            }
        });
    }
    let (ledger, union) = merged.expect("more than one partition answered");
    let bytes = snapshot::encode(&ledger, &union).map_err(|e| internal(e.to_string()))?;
    if bytes.len() > proto::limits::MAX_DOC_BYTES {
        return Err(Failure::invalid(format!(
            "the scopes' slice of {model} is {} bytes, more than a reply carries ({}); replay the scopes' events instead",
            bytes.len(),
            proto::limits::MAX_DOC_BYTES
        )));
    }
    // Partitions answered in partition order, as `by_partition` lists them.
    let held = proto::by_partition(scopes, partitions)
        .into_iter()
        .zip(held)
        .flat_map(|((_, keys), seq)| keys.into_iter().map(move |scope| ScopeHeld { scope, seq }))
        .collect();
    Ok(BootstrapResponse {
        model,
        snapshot: newest,
        skipped,
        bytes: Some(base64::engine::general_purpose::STANDARD.encode(bytes)),
        held,
    })
}
