use super::*;

fn parse(args: &[&str]) -> Result<BenchArgs, BenchError> {
    BenchArgs::from_flags(args)
}

#[test]
fn target_and_overhead_rules() {
    let cases: [(&str, &[&str], Option<usize>); 8] = [
        ("one target", &["--target", "http://a:1"], Some(1)),
        (
            "compare list",
            &["--compare", "a=http://a:1", "b=http://b:1"],
            Some(2),
        ),
        (
            "target plus compare",
            &["--target", "http://a:1", "--compare", "http://b:1"],
            Some(2),
        ),
        (
            "compare with replicas",
            &["--compare", "p=http://a:1,http://b:1", "rr=http://c:1"],
            Some(2),
        ),
        ("bad replica", &["--target", "p=http://a:1,b:1"], None),
        ("none", &[], None),
        (
            "overhead needs two",
            &["--overhead", "--target", "http://a:1"],
            None,
        ),
        (
            "overhead with two",
            &[
                "--overhead",
                "--target",
                "e=http://a:1",
                "--target",
                "r=http://b:1",
            ],
            Some(2),
        ),
    ];
    for (name, args, want) in cases {
        let got = parse(args).unwrap().targets().ok().map(|t| t.len());
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn rate_and_concurrency_conflict_and_replay_needs_a_trace() {
    let err = parse(&["--rate", "5", "--concurrency", "2"])
        .map(|_| ())
        .expect_err("rate and concurrency")
        .to_string();
    assert!(
        err.contains("--rate") && err.contains("--concurrency"),
        "{err}"
    );
    let replay = parse(&["--workload", "replay"]).unwrap();
    let err = replay.workload_spec().expect_err("no trace").to_string();
    assert_eq!(
        err,
        "invalid argument: --workload replay needs --trace FILE"
    );
    let replay = parse(&["--workload", "replay", "--trace", "t.jsonl"]).unwrap();
    assert!(matches!(
        replay.workload_spec(),
        Ok(WorkloadSpec::Replay(_))
    ));
}
