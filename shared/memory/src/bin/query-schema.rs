//! Writes the JSON Schema of the query protocol to stdout, or to the path given as the first
//! argument.

fn main() -> std::io::Result<()> {
    let schema = engram_memory::proto::json_schema();
    let mut text = serde_json::to_string_pretty(&schema).expect("a schema always serialises");
    text.push('\n');
    match std::env::args().nth(1) {
        Some(path) => std::fs::write(path, text),
        None => {
            print!("{text}");
            Ok(())
        }
    }
}
