//! `kvgate doctor` against real engines: ready with everything configured, and the fix it
//! names when `/render` is refused (vLLM serves it only with `--enable-scale-out`).

use super::engine::{EngineSpec, RealEngine};
use super::*;

fn doctor(args: &[String]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .arg("doctor")
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn doctor_finds_a_real_engine_ready() {
    let Some(fleet) = fleet() else { return };
    let e = &fleet.a;
    let (ok, text) = doctor(&[
        e.url(),
        "--kv".into(),
        format!("{}={}", e.url(), e.kv()),
        "--replay".into(),
        format!("{}={}", e.url(), e.replay()),
        "--tokenizer".into(),
        format!("{SERVED}={TOKENIZER}"),
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("precise routing: ready"), "{text}");
    assert!(text.contains("32"), "block size not reported: {text}");
}

#[test]
fn doctor_names_enable_scale_out_when_render_is_refused() {
    let Some((install, _fleet)) = solo() else {
        return;
    };
    let engine = RealEngine::start(
        &install,
        EngineSpec {
            model: "tiny-qwen3",
            cpu: "0",
            args: vec![],
        },
    );
    let (_, text) = doctor(&[
        engine.url(),
        "--kv".into(),
        format!("{}={}", engine.url(), engine.kv()),
    ]);
    assert!(text.contains("403"), "{text}");
    assert!(text.contains("--enable-scale-out"), "{text}");
}
