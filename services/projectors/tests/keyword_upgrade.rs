//! An upgrade that adds a keyword field finds an index of the older schema on disk: the
//! projector removes it and rebuilds from the stream, rather than refusing to start.

use engram_projection_runtime::Projection;
use engram_projectors::keyword::KeywordProjection;

#[tokio::test]
async fn an_index_of_an_older_schema_is_rebuilt_not_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Given an index of another schema where the keyword projector keeps its own
    let old = dir.path().join("keyword");
    std::fs::create_dir_all(&old).unwrap();
    let mut builder = tantivy::schema::Schema::builder();
    builder.add_text_field("body", tantivy::schema::TEXT);
    drop(tantivy::Index::create_in_dir(&old, builder.build()).unwrap());
    // When the projector restores...
    let projection = KeywordProjection::new(dir.path());
    let ledger = projection.restore().await.unwrap();
    // ...then it starts empty, at the beginning of the stream, with an index it can use.
    assert_eq!(ledger.seq, 0);
    assert!(projection.is_empty());
    projection.checkpoint(&ledger).await.unwrap();
}
