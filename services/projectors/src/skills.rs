//! The skill projector: the skill registry behind `engram.p.skills.search`.

use engram_memory::Seq;
use engram_memory::proto::{ErrorCode, SkillsRequest, SkillsResponse};
use engram_projection_runtime::model::SnapshotProjection;
use engram_rpc::Failure;
use engram_skills::SkillRegistry;

pub const NAME: &str = engram_memory::proto::read_models::SKILLS;

pub type SkillsProjection = SnapshotProjection<SkillRegistry>;

/// Answers a skills query: one skill by name, or the best matches for a task description.
pub fn query(
    projection: &SkillsProjection,
    request: &SkillsRequest,
    visible_seq: Seq,
) -> Result<SkillsResponse, Failure> {
    let scopes = request.scopes.resolve().map_err(Failure::invalid)?;
    let registry = projection.read();
    let to_json = |skill: &engram_skills::Skill, score: f32| {
        let mut value = serde_json::to_value(skill)
            .map_err(|e| Failure::new(ErrorCode::Internal, e.to_string()))?;
        value["score"] = serde_json::json!(score);
        Ok::<_, Failure>(value)
    };
    let mut skills = Vec::new();
    match (&request.name, &request.task) {
        (Some(name), _) => {
            for scope in &scopes {
                if let Some(skill) = registry.get(scope, name) {
                    skills.push(to_json(skill, 1.0)?);
                }
            }
        }
        (None, Some(task)) => {
            for (skill, score) in registry.search(&scopes, task, request.limit) {
                skills.push(to_json(skill, score)?);
            }
        }
        (None, None) => return Err(Failure::invalid("give a skill name or a task description")),
    }
    skills.truncate(request.limit);
    Ok(SkillsResponse {
        skills,
        visible_seq,
    })
}

/// The skill read model, as the registry runs it.
pub struct SkillsModel;

#[async_trait::async_trait]
impl crate::ReadModel for SkillsModel {
    const NAME: &'static str = NAME;
    const ENDPOINT: (&'static str, &'static str) =
        (engram_memory::proto::read_models::SEARCH_OP, "skills");
    type Projection = SkillsProjection;
    type Request = SkillsRequest;
    type Response = SkillsResponse;

    fn slice(snapshot: &[u8], keep: &[engram_memory::ScopeKey]) -> Result<Option<Vec<u8>>, String> {
        crate::registry::slice_of::<engram_skills::SkillRegistry>(snapshot, keep, NAME)
    }

    async fn open(
        _config: &crate::ProjectorsConfig,
        dir: &std::path::Path,
        _shared: &crate::Shared,
    ) -> Result<std::sync::Arc<SkillsProjection>, crate::StartError> {
        Ok(std::sync::Arc::new(SkillsProjection::new(NAME, dir)))
    }

    async fn answer(
        projection: std::sync::Arc<SkillsProjection>,
        request: SkillsRequest,
        visible: Seq,
    ) -> Result<SkillsResponse, Failure> {
        crate::off_runtime(move || query(&projection, &request, visible)).await
    }
}
