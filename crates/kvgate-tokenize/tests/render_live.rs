//! Live check (ignored by default): the render backend pointed at a real vLLM render server
//! (`KVGATE_RENDER_URL`, e.g. from `scripts/ci_render_live.sh`) returns every golden.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: panics are failures

use std::path::PathBuf;

use bytes::Bytes;
use kvgate_tokenize::parity::{collect_files, first_divergence, load_case};
use kvgate_tokenize::{RenderBackend, RenderOptions};

#[tokio::test]
#[ignore = "needs a live vLLM render server in KVGATE_RENDER_URL"]
async fn render_backend_returns_the_goldens() {
    let url = std::env::var("KVGATE_RENDER_URL").expect("KVGATE_RENDER_URL");
    let mut opts = RenderOptions::new(url);
    opts.timeout = std::time::Duration::from_secs(60);
    let backend = RenderBackend::new(opts);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/parity");
    let mut failures = Vec::new();
    let files = collect_files(&[root]).unwrap();
    for path in &files {
        let case = load_case(path).unwrap();
        let body = Bytes::from(case.body.clone().into_bytes());
        match backend.tokenize(case.api().unwrap(), &body, false).await {
            Ok(p) => {
                let got: Vec<Vec<u32>> = p.into_iter().map(|x| x.token_ids).collect();
                if let Some(d) = first_divergence(&case.token_ids, &got) {
                    failures.push(format!("{}/{}: {d:?}", case.api, case.name));
                }
            }
            Err(e) => failures.push(format!("{}/{}: {e}", case.api, case.name)),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {}:\n{}",
        failures.len(),
        files.len(),
        failures.join("\n")
    );
}
