//! The real dev split (3 of LoCoMo's 10 conversations), found beside the repository (see
//! [`engram_locomo::locate::dev_split`]) or through `ENGRAM_LOCOMO_DEV`.

use engram_locomo::{Dataset, DiaId, Evaluator};

fn dev() -> Dataset {
    let path = engram_locomo::locate::dev_split().unwrap_or_else(|e| panic!("{e}"));
    Dataset::load(&path).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn counts_match_the_readme() {
    let dataset = dev();
    let counts = dataset.counts();
    assert_eq!(counts.conversations, 3);
    // The README's recall denominator: category 1-4 questions with evidence.
    assert_eq!(counts.questions_asked, 383);
    // conv-26 has two open-domain questions with empty evidence in the file.
    assert_eq!(counts.questions_skipped_no_evidence, 2);
    assert_eq!(counts.questions, 497);
    assert_eq!(counts.questions_adversarial, 112);
    assert_eq!(counts.turns, 419 + 369 + 663);
    assert_eq!(counts.sessions, 19 + 19 + 32);
    // The only odd evidence string in this split is "D8:6; D9:17"; both ids exist.
    assert_eq!(
        counts.unmatched_evidence,
        0,
        "{:?}",
        dataset.unmatched_evidence()
    );
}

#[test]
fn the_packed_evidence_string_becomes_two_ids() {
    let dataset = dev();
    let conv = dataset.conversation("conv-26").unwrap();
    let packed: Vec<_> = conv
        .questions
        .iter()
        .filter(|q| {
            q.evidence.contains(&DiaId::new(8, 6)) && q.evidence.contains(&DiaId::new(9, 17))
        })
        .collect();
    assert_eq!(packed.len(), 1);
    assert_eq!(packed[0].category, 1);
}

#[test]
fn sessions_are_ordered_dated_and_consistent() {
    let dataset = dev();
    for conv in dataset.conversations() {
        assert!(
            conv.sessions.windows(2).all(|w| w[0].index < w[1].index),
            "{}",
            conv.sample_id
        );
        // LoCoMo sessions happen in order, days or weeks apart.
        assert!(
            conv.sessions.windows(2).all(|w| w[0].date < w[1].date),
            "{}",
            conv.sample_id
        );
        for (session, turn) in conv.turns() {
            assert_eq!(turn.dia_id.session, session.index);
            assert!(turn.speaker == conv.speaker_a || turn.speaker == conv.speaker_b);
        }
        for q in &conv.questions {
            for id in &q.evidence {
                assert!(conv.turn(*id).is_some(), "{} {id}", conv.sample_id);
            }
        }
    }
    let first = &dataset.conversation("conv-26").unwrap().sessions[0];
    assert_eq!(first.date.to_rfc3339(), "2023-05-08T13:56:00+00:00");
    let captioned = dataset
        .conversation("conv-26")
        .unwrap()
        .turn(DiaId::new(1, 5))
        .unwrap();
    assert!(
        captioned
            .memory_text()
            .starts_with("Caroline: The transgender stories")
    );
    assert!(captioned.memory_text().ends_with(
        "[shares a photo: a photo of a dog walking past a wall with a painting of a woman]"
    ));
}

#[test]
fn an_oracle_retriever_scores_one_and_a_blind_one_zero() {
    let dataset = dev();
    let mut eval = Evaluator::default().with_dataset(dataset.counts());
    for conv in dataset.conversations() {
        for q in &conv.questions {
            eval.record(
                "oracle",
                q,
                &q.evidence,
                std::time::Duration::from_micros(5),
            );
            eval.record("blind", q, &[], std::time::Duration::from_micros(5));
        }
    }
    let report = eval.report();
    let oracle = &report.mode("oracle").unwrap().overall;
    assert_eq!(oracle.questions, 383);
    // Some questions have more than 5 evidence turns, so only R@20 must be perfect.
    assert_eq!(oracle.turn_recall[&20], 1.0);
    assert_eq!(oracle.session_recall[&20], 1.0);
    assert_eq!(report.mode("blind").unwrap().overall.turn_recall[&20], 0.0);
    let table = report.to_string();
    assert!(!table.contains("note:"), "{table}");
}
