//! Every case in `testdata/parity/` tokenized by the local backend must equal the golden
//! ids recorded from a real vLLM 0.33 render server (`scripts/gen_parity.py`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: panics are failures

use std::path::PathBuf;

use bytes::Bytes;
use kvgate_tokenize::parity::{self, collect_files, first_divergence, load_case};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every case twice: the second pass of a chat, messages or responses case takes the render
/// the first one cached (the counters prove it), and must equal the golden too.
#[test]
fn local_backend_matches_every_golden() {
    // Its own tokenizer, its lookups counted in two series of its own.
    let tok = kvgate_tokenize::LocalTokenizer::load(
        &kvgate_tokenize::test_util::qwen3_dir(),
        kvgate_tokenize::LocalOptions::default(),
    )
    .unwrap();
    let hit_series = prometheus_client::metrics::counter::Counter::<u64>::default();
    tok.count_render_cache(hit_series.clone(), Default::default());
    let files = collect_files(&[root().join("testdata/parity")]).unwrap();
    let mut per_api = std::collections::BTreeMap::<String, usize>::new();
    let mut failures = Vec::new();
    let hits_before = hit_series.get();
    for (pass, path) in [0, 1]
        .into_iter()
        .flat_map(|pass| files.iter().map(move |p| (pass, p)))
    {
        let case = load_case(path).unwrap();
        if pass == 0 {
            *per_api.entry(case.api.clone()).or_default() += 1;
        }
        let api = case.api().unwrap();
        let got = match tok.tokenize(api, &Bytes::from(case.body.clone().into_bytes())) {
            Ok(p) => p.into_iter().map(|x| x.token_ids).collect::<Vec<_>>(),
            Err(e) => {
                failures.push(format!(
                    "{}/{} (pass {pass}): local error: {e}",
                    case.api, case.name
                ));
                continue;
            }
        };
        if let Some(d) = first_divergence(&case.token_ids, &got) {
            let report = parity::describe(&tok, &d, "golden", &case.token_ids, "local", &got);
            failures.push(format!(
                "{}/{} (pass {pass}): {report}",
                case.api, case.name
            ));
        }
    }
    let chats: usize = ["chat_completions", "messages", "responses"]
        .iter()
        .filter_map(|api| per_api.get(*api))
        .sum();
    assert!(
        failures.is_empty(),
        "{} of {} cases diverge:\n{}",
        failures.len(),
        files.len(),
        failures.join("\n")
    );
    let hits = hit_series.get();
    assert!(
        hits - hits_before >= chats as u64,
        "{} render cache hits for {chats} chat cases",
        hits - hits_before
    );
    assert!(
        per_api.get("chat_completions").copied().unwrap_or(0) >= 40,
        "{per_api:?}"
    );
    assert!(
        per_api.get("completions").copied().unwrap_or(0) >= 10,
        "{per_api:?}"
    );
    assert!(
        per_api.get("messages").copied().unwrap_or(0) >= 10,
        "{per_api:?}"
    );
    assert!(
        per_api.get("responses").copied().unwrap_or(0) >= 20,
        "{per_api:?}"
    );
}

/// Prefix sessions leave their ids with the render cache: on a fresh tokenizer, each chat case
/// is encoded by a session to the end; the same bytes then give a session that is complete
/// before any pass, and its ids are the golden ones.
#[test]
fn sessions_give_their_ids_to_the_render_cache() {
    use std::sync::Arc;

    use kvgate_tokenize::{LocalOptions, LocalTokenizer, PrefixSession};

    let tok = Arc::new(
        LocalTokenizer::load(
            &kvgate_tokenize::test_util::qwen3_dir(),
            LocalOptions::default(),
        )
        .unwrap(),
    );
    let files = collect_files(&[root().join("testdata/parity")]).unwrap();
    let mut chats = 0;
    for path in &files {
        let case = load_case(path).unwrap();
        if !matches!(
            case.api.as_str(),
            "chat_completions" | "messages" | "responses"
        ) {
            continue;
        }
        let api = case.api().unwrap();
        let body = case.body.as_bytes();
        let Ok(mut first) = PrefixSession::new(Arc::clone(&tok), api, body) else {
            panic!("{}/{}: no session", case.api, case.name);
        };
        // Complete at once only when an earlier case sent the same bytes.
        first.advance(usize::MAX).unwrap();
        assert!(first.is_complete(), "{}/{}", case.api, case.name);
        let again = tok.tokenize_prefix(api, body, 1).unwrap();
        assert!(
            again.complete,
            "{}/{}: ids not memoized",
            case.api, case.name
        );
        let expected = case.token_ids.first().cloned().unwrap_or_default();
        assert_eq!(again.token_ids, expected, "{}/{}", case.api, case.name);
        chats += 1;
    }
    assert!(chats >= 70, "{chats} chat cases");
}
