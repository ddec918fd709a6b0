//! Where to go next: a freshly issued API key, checked on this engram's own HTTP address (the
//! HTTP API, an MCP session and the inspector answer it), the commands that connect Claude
//! Code and Cursor with it, and the Python client's install.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use engram_access::{AccessLog, Record};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{Demo, SECTIONS};

/// How long a new key may take to work: the server takes it with its next authorization
/// reload, moments after it is issued.
const KEY_LIVE_WITHIN: Duration = Duration::from_secs(30);

pub(super) async fn run(demo: &Demo<'_>) -> anyhow::Result<()> {
    let addr = demo.running.http_addr;
    let scope = demo.task.to_string();
    let agent = engram_schema::Ident::parse("agent", "coder")?;
    let log = AccessLog::new(demo.running.bus.client().clone());
    if !log.load().await?.tenants.contains_key(&demo.tenant) {
        log.append(
            Record::TenantAdded {
                tenant: demo.tenant.clone(),
            },
            "engram-demo",
        )
        .await?;
    }
    let (creds, scopes, issued) =
        crate::commands::access::issue(&log, &demo.tenant, &agent, &[]).await?;
    // The server refuses the key until its authorization holds it: wait for that rather
    // than knock (each refused connection logs an authorization violation).
    if let Some(enforced) = &demo.running.access_enforced {
        anyhow::ensure!(
            enforced.clone().reached(issued, KEY_LIVE_WITHIN).await,
            "the server's authorization did not take the new key within {KEY_LIVE_WITHIN:?} (it enforces registry seq {}, the key is seq {issued}); see the log for a failed reload",
            enforced.seq()
        );
    }
    let scopes: Vec<String> = scopes.iter().map(ToString::to_string).collect();
    let key = creds
        .api_key()
        .context("agent credentials without an API key")?;
    let public = creds.public_key();

    // The key works on this address: whoami answers for it, /mcp opens a session with it.
    let auth = format!("Authorization: Bearer {key}");
    let deadline = Instant::now() + KEY_LIVE_WITHIN;
    let whoami = loop {
        let (status, body) = http(addr, &format!("GET /v1/whoami HTTP/1.1\r\n{auth}"), "").await?;
        if status == 200 {
            break body;
        }
        anyhow::ensure!(
            status == 401 && Instant::now() < deadline,
            "the new key is refused by {addr}: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let me: serde_json::Value =
        serde_json::from_str(&whoami).with_context(|| format!("whoami answered {whoami}"))?;
    anyhow::ensure!(
        me["tenant"] == "acme" && me["agent"] == "coder",
        "whoami answered for another identity: {whoami}"
    );
    let initialize = serde_json::json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "engram-demo", "version": "0"}},
    })
    .to_string();
    let (status, body, session) = exchange(
        addr,
        &format!(
            "POST /mcp HTTP/1.1\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\n{auth}\r\nEngram-Scope: {scope}"
        ),
        &initialize,
    )
    .await?;
    anyhow::ensure!(
        status == 200 && body.contains("serverInfo"),
        "/mcp did not open a session for the new key: {status} {body}"
    );
    if let Some(session) = session {
        // Only a check: close the session again.
        let _ = http(
            addr,
            &format!("DELETE /mcp HTTP/1.1\r\n{auth}\r\nMcp-Session-Id: {session}"),
            "",
        )
        .await;
    }
    let (status, page) = http(addr, "GET /inspector HTTP/1.1", "").await?;
    anyhow::ensure!(
        status == 200 && page.contains("<html"),
        "/inspector answered {status}"
    );

    let exe =
        std::env::current_exe().map_or_else(|_| "engram".to_owned(), |p| p.display().to_string());
    let nats = engram_bus::config::redact_url(&demo.running.nats_url);
    println!(
        "\n{} connect a model harness, look around, script it ==",
        SECTIONS[10]
    );
    println!(
        "  a fresh API key for agent \"coder\" of tenant acme (public key {public}, scopes {}; shown once):",
        scopes.join(" ")
    );
    println!("    {key}");
    println!("  it works here: whoami answers for acme/coder, and /mcp opened a session with it");
    println!("  Claude Code (HTTP):");
    println!(
        "    claude mcp add --transport http engram http://{addr}/mcp --header \"Authorization: Bearer {key}\" --header \"Engram-Scope: {scope}\""
    );
    println!("  Cursor (~/.cursor/mcp.json, stdio):");
    println!(
        "    {{ \"mcpServers\": {{ \"engram\": {{ \"command\": \"{exe}\", \"args\": [\"--nats\", \"{nats}\", \"mcp\", \"--scope\", \"{scope}\"], \"env\": {{ \"ENGRAM_API_KEY\": \"{key}\" }} }} }} }}"
    );
    println!("  the memory inspector (paste the key): http://{addr}/inspector");
    println!(
        "  Python, from the repository's root: pip install ./clients/python   (then Engram(\"http://{addr}\", \"<the key>\", scope=\"{scope}\"))"
    );
    Ok(())
}

/// One HTTP/1.1 request to `addr` (`head`: the request line and headers, without Host and
/// Content-Length); its status and body.
async fn http(addr: SocketAddr, head: &str, body: &str) -> anyhow::Result<(u16, String)> {
    let (status, body, _) = exchange(addr, head, body).await?;
    Ok((status, body))
}

/// [`http`], with the `Mcp-Session-Id` the answer carries.
async fn exchange(
    addr: SocketAddr,
    head: &str,
    body: &str,
) -> anyhow::Result<(u16, String, Option<String>)> {
    let work = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        let request = format!(
            "{head}\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        anyhow::Ok(String::from_utf8_lossy(&response).into_owned())
    };
    let response = tokio::time::timeout(Duration::from_secs(20), work)
        .await
        .with_context(|| format!("{addr} did not answer {head:?} within 20s"))??;
    let (top, rest) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let chunked = top
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    let status = top
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no HTTP status in {top:?}"))?;
    let session = top.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("mcp-session-id")
            .then(|| value.trim().to_owned())
    });
    Ok((status, body, session))
}

/// The body of a chunked response.
fn dechunk(mut rest: &str) -> String {
    let mut body = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16) else {
            break;
        };
        let (Some(chunk), Some(next)) = (after.get(..n), after.get(n..)) else {
            break;
        };
        if n == 0 {
            break;
        }
        body.push_str(chunk);
        rest = next.trim_start_matches("\r\n");
    }
    body
}
