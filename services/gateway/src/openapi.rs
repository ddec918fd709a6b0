//! The OpenAPI 3.1 document of `/v1`, generated from the Rust types the handlers decode and
//! answer with: the same types (and the same `schemars` derivations) as the NATS protocol's
//! JSON Schema in `schemas/json/query.v1.json`, so the two cannot drift apart.

use engram_memory::proto;
use schemars::JsonSchema;

use crate::routes::{
    Appended, Consolidated, DocEditRequest, DocEdited, EraseRequest, ForgetRequest, Receipt,
};
use crate::tail::TailQuery;

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
        "/v1/brief": operation("A task's handoff brief: its sessions, what was decided and why, what failed and how it was fixed, what is open, which skills apply, its artifacts; every line citing its events. JSON and Markdown.", schema(s::<proto::BriefRequest>), schema(s::<proto::BriefResponse>)),
        "/v1/working": operation("Working memory of the own scope: put, get, delete, list.", schema(s::<proto::WorkingRequest>), schema(s::<proto::WorkingResponse>)),
        "/v1/docs/edit": operation("Edit a shared document by JSON pointer (set and delete in one change), pushed as the key's agent; returns the seq and the document with its conflicts.", schema(s::<DocEditRequest>), schema(s::<DocEdited>)),
        "/v1/forget": operation("Withdraw memories of a scope from retrieval: one forgotten event naming them.", schema(s::<ForgetRequest>), schema(s::<Receipt>)),
        "/v1/consolidate": operation("Consolidate one scope now (dedup, summarise, decay, or restore), appended as the key's agent; dry_run only plans.", schema(s::<crate::routes::ConsolidateBody>), schema(s::<Consolidated>)),
        "/v1/snapshots": operation("The snapshot index: every read model's snapshots, metadata only.", schema(s::<crate::routes::SnapshotsBody>), schema(s::<proto::SnapshotsResponse>)),
        "/v1/bootstrap": operation("One model's slice of its newest good snapshot for the readable scopes; replay after its version.", schema(s::<proto::BootstrapRequest>), schema(s::<proto::BootstrapResponse>)),
        "/v1/scopes": operation("The tenant's scopes that hold events and that this key may read, with counts by kind.", schema(s::<proto::ScopesRequest>), schema(s::<proto::ScopesResponse>)),
        "/v1/dead_letters": operation("The newest events a projector refused, of the scopes this key may read.", schema(s::<proto::DeadLettersRequest>), schema(s::<proto::DeadLettersResponse>)),
        "/v1/erase": operation("Verified erasure. Only the admin identity may delete from the log; an API key is an agent's, so this answers 403 with the command to run.", schema(s::<EraseRequest>), serde_json::json!({"type": "object"})),
        "/v1/whoami": {"get": {
            "summary": "The key's tenant, agent, scopes and grants.",
            "security": [{"apiKey": []}],
            "responses": {
                "200": {"description": "the answer", "content": {"application/json": {"schema": schema(s::<proto::WhoamiResponse>)}}},
                "default": {"description": "an error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            },
        }},
        "/v1/tail": {"get": {
            "summary": "A live tail of the readable scopes as Server-Sent Events: event `memory`, id = seq, data = the replayed event; resume with Last-Event-ID.",
            "security": [{"apiKey": []}],
            "parameters": tail_parameters(schema(s::<TailQuery>)),
            "responses": {
                "200": {"description": "an event stream", "content": {"text/event-stream": {"schema": schema(s::<proto::ReplayedEvent>)}}},
                "default": {"description": "an error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            },
        }},
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

/// The tail's query string as OpenAPI parameters, from its type's schema.
fn tail_parameters(schema: serde_json::Value) -> serde_json::Value {
    let required: Vec<&str> = schema["required"]
        .as_array()
        .map(|r| r.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    let params: Vec<serde_json::Value> = schema["properties"]
        .as_object()
        .map(|props| {
            props
                .iter()
                .map(|(name, prop)| {
                    serde_json::json!({
                        "name": name,
                        "in": "query",
                        "required": required.contains(&name.as_str()),
                        "description": prop.get("description").cloned().unwrap_or_default(),
                        "schema": prop,
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    serde_json::Value::Array(params)
}

/// `GET /reference`: the document rendered as one HTML page, on the server, with no script:
/// every route with its summary and its request and answer fields.
pub async fn reference() -> axum::response::Html<String> {
    axum::response::Html(render(&document()))
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The name a `$ref` points at, or the type of an inline schema.
fn type_of(schema: &serde_json::Value) -> String {
    if let Some(r) = schema.get("$ref").and_then(|r| r.as_str()) {
        let name = r.rsplit('/').next().unwrap_or(r);
        return format!("<a href=\"#schema-{0}\">{0}</a>", esc(name));
    }
    if let Some(all) = schema
        .get("allOf")
        .or_else(|| schema.get("anyOf"))
        .or_else(|| schema.get("oneOf"))
        .and_then(|a| a.as_array())
    {
        return all.iter().map(type_of).collect::<Vec<_>>().join(" | ");
    }
    match schema.get("type") {
        Some(serde_json::Value::String(t)) if t == "array" => {
            format!(
                "array of {}",
                schema.get("items").map(type_of).unwrap_or_default()
            )
        }
        Some(serde_json::Value::String(t)) => esc(t),
        Some(serde_json::Value::Array(ts)) => ts
            .iter()
            .filter_map(|t| t.as_str())
            .map(esc)
            .collect::<Vec<_>>()
            .join(" | "),
        _ if schema.get("enum").is_some() => "enum".into(),
        _ => "any".into(),
    }
}

/// A schema's fields as a table (or its type, when it has none).
fn fields(schema: &serde_json::Value, out: &mut String) {
    let Some(props) = schema.get("properties").and_then(|p| p.as_object()) else {
        out.push_str(&format!("<p class=\"type\">{}</p>", type_of(schema)));
        if let Some(values) = schema.get("enum").and_then(|e| e.as_array()) {
            let values: Vec<String> = values.iter().map(|v| esc(&v.to_string())).collect();
            out.push_str(&format!("<p>one of {}</p>", values.join(", ")));
        }
        return;
    };
    let required: Vec<&str> = schema["required"]
        .as_array()
        .map(|r| r.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    out.push_str("<table><tr><th>field</th><th>type</th><th></th><th>description</th></tr>");
    for (name, prop) in props {
        let description = prop
            .get("description")
            .and_then(|d| d.as_str())
            .unwrap_or("");
        out.push_str(&format!(
            "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(name),
            type_of(prop),
            if required.contains(&name.as_str()) {
                "required"
            } else {
                ""
            },
            esc(description)
        ));
    }
    out.push_str("</table>");
}

fn render(doc: &serde_json::Value) -> String {
    let mut out = String::from(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Engram HTTP API reference</title><style>body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#1d2330}code{background:#f1f3f7;padding:0 .25rem;border-radius:3px}h2{margin-top:2.5rem;border-top:1px solid #dde;padding-top:1rem}table{border-collapse:collapse;width:100%;margin:.5rem 0 1rem}td,th{border:1px solid #dde;padding:.3rem .5rem;text-align:left;vertical-align:top}th{background:#f6f7fa}.method{font-weight:700;color:#2451b7}</style></head><body><h1>Engram HTTP API</h1><p>Every route takes <code>Authorization: Bearer &lt;API key&gt;</code> (from <code>engram key add</code>). <code>tenant</code> defaults to the key's; naming another is 403. Errors are <code>{\"error\": {\"code\", \"message\"}}</code> with a stable code. The machine-readable document is <a href=\"/openapi.json\">/openapi.json</a>.</p><ul>",
    );
    let paths = doc["paths"].as_object().cloned().unwrap_or_default();
    for (path, ops) in &paths {
        for method in ops
            .as_object()
            .map(|o| o.keys().cloned().collect::<Vec<_>>())
            .unwrap_or_default()
        {
            out.push_str(&format!(
                "<li><a href=\"#{m}-{p}\"><span class=\"method\">{M}</span> <code>{p}</code></a></li>",
                m = esc(&method),
                M = esc(&method.to_uppercase()),
                p = esc(path)
            ));
        }
    }
    out.push_str("</ul>");
    for (path, ops) in &paths {
        let Some(ops) = ops.as_object() else { continue };
        for (method, op) in ops {
            out.push_str(&format!(
                "<h2 id=\"{m}-{p}\"><span class=\"method\">{M}</span> <code>{p}</code></h2><p>{}</p>",
                esc(op["summary"].as_str().unwrap_or("")),
                m = esc(method),
                M = esc(&method.to_uppercase()),
                p = esc(path)
            ));
            if let Some(params) = op.get("parameters").and_then(|p| p.as_array()) {
                out.push_str("<h3>query parameters</h3><table><tr><th>name</th><th>type</th><th></th><th>description</th></tr>");
                for p in params {
                    out.push_str(&format!(
                        "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td></tr>",
                        esc(p["name"].as_str().unwrap_or("")),
                        type_of(&p["schema"]),
                        if p["required"].as_bool() == Some(true) {
                            "required"
                        } else {
                            ""
                        },
                        esc(p["description"].as_str().unwrap_or(""))
                    ));
                }
                out.push_str("</table>");
            }
            if let Some(body) = op.pointer("/requestBody/content/application~1json/schema") {
                out.push_str("<h3>request</h3>");
                fields(&resolve(doc, body), &mut out);
            }
            if let Some(answer) = op
                .pointer("/responses/200/content")
                .and_then(|c| c.as_object())
                .and_then(|c| c.values().next())
                .and_then(|c| c.get("schema"))
            {
                out.push_str("<h3>answer</h3>");
                fields(&resolve(doc, answer), &mut out);
            }
        }
    }
    out.push_str("<h2>Types</h2>");
    if let Some(schemas) = doc
        .pointer("/components/schemas")
        .and_then(|s| s.as_object())
    {
        for (name, schema) in schemas {
            out.push_str(&format!("<h3 id=\"schema-{0}\">{0}</h3>", esc(name)));
            if let Some(d) = schema.get("description").and_then(|d| d.as_str()) {
                out.push_str(&format!("<p>{}</p>", esc(d)));
            }
            fields(schema, &mut out);
        }
    }
    out.push_str("</body></html>");
    out
}

/// A `$ref` replaced by what it names (one level: the page links nested types).
fn resolve(doc: &serde_json::Value, schema: &serde_json::Value) -> serde_json::Value {
    schema
        .get("$ref")
        .and_then(|r| r.as_str())
        .and_then(|r| r.strip_prefix('#'))
        .and_then(|pointer| doc.pointer(pointer))
        .cloned()
        .unwrap_or_else(|| schema.clone())
}
