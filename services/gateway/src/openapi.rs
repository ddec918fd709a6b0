//! The OpenAPI 3.1 document of `/v1`, generated from the Rust types the handlers decode and
//! answer with: the same types (and the same `schemars` derivations) as the NATS protocol's
//! JSON Schema in `schemas/json/query.v1.json`, so the two cannot drift apart.

use engram_memory::proto;
use schemars::JsonSchema;

use crate::routes::Appended;

/// One route: path, summary, request and response schemas.
fn operation(
    summary: &str,
    request: serde_json::Value,
    response: serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({
        "post": {
            "summary": summary,
            "security": [{"apiKey": []}],
            "requestBody": {"required": true, "content": {"application/json": {"schema": request}}},
            "responses": {
                "200": {"description": "the answer", "content": {"application/json": {"schema": response}}},
                "default": {"description": "an error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            },
        }
    })
}

/// The whole document.
pub fn document() -> serde_json::Value {
    let mut generator = schemars::generate::SchemaSettings::openapi3().into_generator();
    let mut schema = |f: fn(&mut schemars::SchemaGenerator) -> schemars::Schema| {
        serde_json::to_value(f(&mut generator)).unwrap_or_default()
    };
    fn s<T: JsonSchema>(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
        g.subschema_for::<T>()
    }
    let paths = serde_json::json!({
        "/v1/events": operation(
            "Append one event, or an array of at most 1000 (checked whole first). tenant and agent_id default to the key's.",
            serde_json::json!({"oneOf": [{"type": "object"}, {"type": "array", "items": {"type": "object"}, "maxItems": 1000}], "description": "envelope v1 (schemas/json/envelope.v1.json); event_id, times and schema_version may be left out"}),
            schema(s::<Appended>),
        ),
        "/v1/retrieve": operation("Hybrid retrieval with score parts; min_seq reads your writes.", schema(s::<proto::RetrieveRequest>), schema(s::<proto::RetrieveResponse>)),
        "/v1/context": operation("The memory for one agent step, within a token budget.", schema(s::<proto::ContextRequest>), schema(s::<proto::Context>)),
        "/v1/facts": operation("Facts now, as of a valid time, as known at a transaction time, or a fact's history.", schema(s::<proto::FactsRequest>), schema(s::<proto::FactsResponse>)),
        "/v1/skills": operation("One skill by name, or the skills best matching a task.", schema(s::<proto::SkillsRequest>), schema(s::<proto::SkillsResponse>)),
        "/v1/docs": operation("A shared document's state and conflicts, its history, or the documents of the readable scopes.", schema(s::<proto::DocRequest>), schema(s::<proto::DocResponse>)),
        "/v1/replay": operation("One page of the events of the readable scopes, in stream order.", schema(s::<proto::ReplayRequest>), schema(s::<proto::ReplayResponse>)),
        "/v1/working": operation("Working memory of the own scope: put, get, delete, list.", schema(s::<proto::WorkingRequest>), schema(s::<proto::WorkingResponse>)),
    });
    let mut schemas: serde_json::Map<String, serde_json::Value> =
        generator.take_definitions(true).into_iter().collect();
    schemas.insert(
        "Error".into(),
        serde_json::json!({
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "object", "required": ["code", "message"], "properties": {
                "code": {"type": "string", "description": "stable: invalid, unauthenticated, forbidden, not_yet_visible, busy, rate_limited, too_large, conflict, unavailable, internal"},
                "message": {"type": "string"},
            }}},
        }),
    );
    serde_json::json!({
        "openapi": "3.1.0",
        "info": {"title": "Engram HTTP API", "version": "1"},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": "an API key from `engram key add`"}},
        },
    })
}
