use std::time::Instant;

use kvgate_kvcache::{BlockStored, EndpointKey, EndpointSpec, IndexConfig, KvEvent, KvMetrics};

use super::*;
use crate::config::SchedulerConfig;
use crate::cycle::RequestFacts;
use crate::endpoint::ROLE_LABEL;
use crate::load::InFlightGuard;
use crate::test_util::{Ep, ep, facts};

fn handles(precise: bool) -> SchedulerHandles {
    SchedulerHandles {
        kv_index: KvIndex::new(IndexConfig::default(), KvMetrics::unregistered()),
        metrics: ScheduleMetrics::unregistered(),
        precise,
    }
}

/// Handles whose index knows `addrs` (ids 0, 1, … in order), the one with id `holder`
/// holding the first 4 blocks (64 tokens) of prompts that start with tokens 0, 1, 2, ….
fn handles_with_holder(addrs: &[&str], holder: u32) -> SchedulerHandles {
    let h = handles(true);
    for a in addrs {
        h.kv_index.register_endpoint(EndpointSpec {
            key: EndpointKey::new(*a, 0),
            model: "m".into(),
            block_size: 16,
            capacity_blocks: None,
        });
    }
    h.kv_index.apply_event(
        kvgate_kvcache::EndpointId(holder),
        &KvEvent::BlockStored(BlockStored {
            block_hashes: (1..=4u64).map(Into::into).collect(),
            token_ids: (0..64).collect(),
            block_size: 16,
            ..BlockStored::default()
        }),
    );
    h
}

fn build(yaml: &str) -> Result<Scheduler, SchedulerConfigError> {
    Scheduler::from_config(&SchedulerConfig::from_yaml(yaml)?, &handles(true))
}

fn lines(e: &SchedulerConfigError) -> Vec<u32> {
    e.issues().iter().map(|i| i.line).collect()
}

#[test]
fn config_errors_name_the_line() {
    // (name, yaml, expected line, word in message)
    let cases = [
        (
            "unknown type",
            "plugins:\n  - type: queue-scorer\n  - type: quue-scorer\nprofiles:\n  - name: p\n    plugins: [{ ref: queue-scorer }]\n",
            3,
            "unknown plugin type `quue-scorer`",
        ),
        (
            "unknown parameter",
            "plugins:\n  - type: token-load-scorer\n    parameters:\n      queue_threshold_tokens: 10\n      typo_tokens: 5\n",
            5,
            "typo_tokens",
        ),
        (
            "bad parameter type",
            "plugins:\n  - type: role-filter\n    parameters:\n\n      role: sideways\n",
            5,
            "sideways",
        ),
        (
            "bad parameter value",
            "plugins:\n  - type: token-load-scorer\n    parameters: { queue_threshold_tokens: 0 }\n",
            3,
            "queue_threshold_tokens",
        ),
        (
            "dangling ref",
            "plugins:\n  - type: queue-scorer\nprofiles:\n  - name: p\n    plugins:\n      - { ref: queue-scorer, weight: 2 }\n      - { ref: kv-scorer }\n",
            7,
            "no plugin named `kv-scorer`",
        ),
        (
            "weight on a picker",
            "plugins:\n  - type: max-score-picker\nprofiles:\n  - name: p\n    plugins:\n      - { ref: max-score-picker, weight: 2 }\n",
            6,
            "only scorers take a weight",
        ),
        (
            "handler references an unknown profile",
            "plugins:\n  - type: queue-scorer\nscheduling:\n  profile_handler:\n    type: pd-profile-handler\n    parameters: { decode_profile: default, prefill_profile: nope }\n",
            6,
            "nope",
        ),
    ];
    for (name, yaml, line, word) in cases {
        let e = build(yaml).unwrap_err();
        assert_eq!(lines(&e), vec![line], "{name}: {e}");
        let msg = e.to_string();
        assert!(msg.contains(word), "{name}: {msg}");
        assert!(msg.contains(&format!("line {line}")), "{name}: {msg}");
    }
}

#[test]
fn every_error_is_collected() {
    let yaml = "plugins:\n  - type: nope-scorer\n  - type: queue-scorer\n    parameters: { x: 1 }\nprofiles:\n  - name: p\n    plugins: [{ ref: gone }]\n";
    let e = build(yaml).unwrap_err();
    assert_eq!(lines(&e), vec![2, 4, 7], "{e}");
}

#[test]
fn defaults_and_implicit_profile() {
    let s = Scheduler::from_config(&SchedulerConfig::default(), &handles(true)).unwrap();
    assert_eq!(s.profile_names(), vec!["default"]);
    let names: Vec<&str> = s.profiles[0]
        .scorers
        .iter()
        .map(|w| w.name.as_str())
        .collect();
    let weights: Vec<f64> = s.profiles[0].scorers.iter().map(|w| w.weight).collect();
    assert_eq!(
        names,
        vec!["precise-prefix-cache-scorer", "prefill-cost-scorer"]
    );
    assert_eq!(weights, vec![0.0, 1.0]);
    assert_eq!(s.profiles[0].picker.0, "max-score-picker");
    assert_eq!(s.profile_handler(), "single-profile-handler");
    let approx = Scheduler::from_config(&SchedulerConfig::default(), &handles(false)).unwrap();
    assert_eq!(
        approx.profiles[0].scorers[0].name,
        "approx-prefix-cache-scorer"
    );
    let weighted = SchedulerConfig::builtin("weighted", true).unwrap();
    let weighted = Scheduler::from_config(&weighted, &handles(true)).unwrap();
    let weights: Vec<f64> = weighted.profiles[0]
        .scorers
        .iter()
        .map(|w| w.weight)
        .collect();
    assert_eq!(weights, vec![3.0, 2.0, 2.0]);
    assert_eq!(SchedulerConfig::builtin("nope", true), None);
    let implicit = build("plugins:\n  - type: queue-scorer\n  - type: random-picker\n").unwrap();
    assert_eq!(implicit.profiles[0].scorers.len(), 1);
    assert_eq!(implicit.profiles[0].picker.0, "random-picker");
}

fn schedule(s: &Scheduler, eps: &[Ep], f: RequestFacts) -> Result<Decision, ScheduleError> {
    let now = Instant::now();
    let built: Vec<Arc<EndpointState>> = eps.iter().map(|e| e.build(now)).collect();
    let mut cycle = CycleState::new(f, now);
    s.schedule(&mut cycle, &built)
}

/// Picks of `n` requests with one request id, by a random picker over four endpoints.
fn random_picks(s: &Scheduler, n: usize) -> Vec<String> {
    let eps = [ep("a:1"), ep("b:1"), ep("c:1"), ep("d:1")];
    let f = RequestFacts {
        request_id: "reused".into(),
        ..facts()
    };
    (0..n)
        .map(|_| {
            schedule(s, &eps, f.clone())
                .unwrap()
                .endpoint()
                .name()
                .to_owned()
        })
        .collect()
}

#[test]
fn a_seed_makes_random_picks_reproducible() {
    let yaml = |seed: &str| format!("plugins:\n  - type: random-picker\n{seed}");
    let picks = |seed: &str| random_picks(&build(&yaml(seed)).unwrap(), 32);
    assert_eq!(picks("seed: 7\n"), picks("seed: 7\n"), "same seed");
    assert_ne!(picks("seed: 7\n"), picks("seed: 8\n"), "other seed");
    assert_ne!(picks(""), picks(""), "no seed: OS entropy");
    let unseeded = random_picks(&build(&yaml("")).unwrap(), 32);
    assert!(
        unseeded.iter().any(|p| *p != unseeded[0]),
        "one request id, {unseeded:?}"
    );
}

#[test]
fn picks_by_weighted_scores_and_explains() {
    let s = build(
        "plugins:\n  - type: queue-scorer\n  - type: kv-cache-utilization-scorer\n    name: kv\n  - type: role-filter\nprofiles:\n  - name: main\n    plugins:\n      - { ref: role-filter }\n      - { ref: queue-scorer, weight: 1 }\n      - { ref: kv, weight: 3 }\n",
    )
    .unwrap();
    let eps = [
        ep("a:1").waiting(0.0).kv(0.9),
        ep("b:1").waiting(10.0).kv(0.1),
        ep("p:1").label(ROLE_LABEL, "prefill").waiting(0.0).kv(0.0),
    ];
    let d = schedule(&s, &eps, facts()).unwrap();
    assert_eq!(
        d.endpoint().name(),
        "b:1",
        "kv weight 3 beats queue weight 1"
    );
    let run = d.primary();
    assert_eq!(run.dropped.len(), 1);
    assert_eq!(
        (
            run.dropped[0].endpoint.name(),
            run.dropped[0].filter.as_str()
        ),
        ("p:1", "role-filter")
    );
    assert_eq!(run.totals.len(), 2);
    assert!((run.weighted_score(1, 1) - 2.7).abs() < 1e-9);
    assert_eq!(
        d.scores_header(),
        "ep=b:1 total=2.70 queue=0.00 kv=0.90; ep=a:1 total=1.30 queue=1.00 kv=0.10"
    );
    assert_eq!(d.kind(), "single");
    assert_eq!(d.predicted_cached_tokens(), None);
    let view = serde_json::to_value(d.to_view()).unwrap();
    assert_eq!(view["runs"][0]["dropped"][0][1], "role-filter");
}

#[test]
fn errors_are_typed() {
    let s = build("plugins:\n  - type: role-filter\n    parameters: { role: prefill }\n").unwrap();
    assert_eq!(
        schedule(&s, &[], facts()).unwrap_err(),
        ScheduleError::NoCandidates
    );
    assert_eq!(
        schedule(&s, &[ep("a:1")], facts()).unwrap_err(),
        ScheduleError::AllFiltered {
            profile: "default".into(),
            filter: "role-filter".into()
        }
    );
}

#[test]
fn guards_count_in_flight_until_dropped() {
    let s = Scheduler::from_config(&SchedulerConfig::default(), &handles(false)).unwrap();
    let now = Instant::now();
    let e = ep("a:1").build(now);
    let mut cycle = CycleState::new(facts().with_tokens(vec![1; 40], false, vec![]), now);
    let mut d = s.schedule(&mut cycle, std::slice::from_ref(&e)).unwrap();
    assert_eq!((e.in_flight_requests(), e.in_flight_tokens()), (1, 40));
    let guards = d.take_guards();
    drop(d);
    assert_eq!(e.in_flight_requests(), 1, "guards outlive the decision");
    drop(guards);
    assert_eq!((e.in_flight_requests(), e.in_flight_tokens()), (0, 0));
}

const PD: &str = "plugins:
  - type: role-filter
    name: decode-filter
  - type: role-filter
    name: prefill-filter
    parameters: { role: prefill }
  - type: precise-prefix-cache-scorer
    parameters: { speculative: false }
  - type: queue-scorer
profiles:
  - name: prefill
    plugins: [{ ref: prefill-filter }, { ref: queue-scorer }]
  - name: decode
    plugins: [{ ref: decode-filter }, { ref: precise-prefix-cache-scorer, weight: 3 }, { ref: queue-scorer }]
scheduling:
  profile_handler:
    type: pd-profile-handler
    parameters: { non_cached_tokens: 32 }
";

#[test]
fn prefill_decode_disaggregation() {
    // d1 holds the first 4 blocks (64 tokens).
    let h = handles_with_holder(&["d1:1", "d2:1", "p1:1"], 0);
    let s = Scheduler::from_config(&SchedulerConfig::from_yaml(PD).unwrap(), &h).unwrap();
    let eps = || {
        vec![
            ep("d1:1")
                .label(ROLE_LABEL, "decode")
                .kv_id(0, true)
                .waiting(5.0),
            ep("d2:1")
                .label(ROLE_LABEL, "decode")
                .kv_id(1, true)
                .waiting(0.0),
            ep("p1:1")
                .label(ROLE_LABEL, "prefill")
                .kv_id(2, true)
                .waiting(0.0),
        ]
    };
    let toks =
        |from: u32, to: u32| facts().with_tokens((from..to).collect::<Vec<u32>>(), true, vec![]);
    // (name, prompt token range, decode pick, prefiller header)
    let cases = [
        ("cached prefix, short suffix: local", (0, 80), "d1:1", None),
        (
            "long uncached suffix: remote prefill",
            (0, 96),
            "d1:1",
            Some("p1:1"),
        ),
        (
            "cold short prompt: local, shortest queue",
            (1000, 1020),
            "d2:1",
            None,
        ),
        (
            "cold long prompt: remote prefill",
            (1000, 1100),
            "d2:1",
            Some("p1:1"),
        ),
    ];
    for (name, (from, to), decode, prefiller) in cases {
        let d = schedule(&s, &eps(), toks(from, to)).unwrap();
        assert_eq!(d.endpoint().name(), decode, "{name}");
        assert_eq!(d.prefiller_host_port(), prefiller, "{name}");
        assert_eq!(
            d.kind(),
            if prefiller.is_some() {
                "prefill-decode"
            } else {
                "decode-only"
            },
            "{name}"
        );
    }
    // No prefill endpoint healthy: decode locally, the failed run is reported.
    let only_decode: Vec<Ep> = eps().into_iter().take(2).collect();
    let d = schedule(&s, &only_decode, toks(0, 96)).unwrap();
    assert_eq!((d.prefiller_host_port(), d.failed().len()), (None, 1));
    assert!(d.scores_header().starts_with("ep=d1:1"));
}

#[test]
fn simultaneous_cycles_see_each_others_picks() {
    // As many threads as endpoints schedule cold requests at the same instant, round after
    // round, holding their guards: with the load each pick adds visible to the next cycle,
    // every round spreads over all the endpoints. Cycles that overlapped would read the load
    // from before either pick and put two requests on one engine.
    const N: usize = 4;
    let s = Arc::new(
        Scheduler::from_config(&SchedulerConfig::cost_profile(false), &handles(false)).unwrap(),
    );
    let now = Instant::now();
    let eps: Arc<Vec<Arc<EndpointState>>> =
        Arc::new((0..N).map(|i| ep(&format!("e{i}:1")).build(now)).collect());
    for round in 0..200 {
        let barrier = Arc::new(std::sync::Barrier::new(N));
        let picks: Vec<(String, Vec<InFlightGuard>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..N)
                .map(|t| {
                    let (s, eps, barrier) =
                        (Arc::clone(&s), Arc::clone(&eps), Arc::clone(&barrier));
                    scope.spawn(move || {
                        let facts = RequestFacts {
                            request_id: format!("r{round}-{t}").into(),
                            prompt_tokens: Some(2048),
                            ..facts()
                        };
                        let mut cycle = CycleState::new(facts, Instant::now());
                        barrier.wait();
                        let mut d = s.schedule(&mut cycle, &eps).unwrap();
                        (d.endpoint().name().to_owned(), d.take_guards())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let all: Vec<&str> = picks.iter().map(|(n, _)| n.as_str()).collect();
        let mut names = all.clone();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), N, "round {round}: picks {all:?}");
    }
}

/// A dry pick finds the endpoint the cycle picks and leaves everything as it was: no request
/// in flight, no speculative holdings, no decision counted. One handler running two profiles
/// has no single pick.
#[test]
fn a_dry_pick_finds_the_pick_and_changes_nothing() {
    // b holds the first 4 blocks (64 tokens) of the prompt.
    let h = handles_with_holder(&["a:1", "b:1"], 1);
    let s = Scheduler::from_config(&SchedulerConfig::default_profile(true), &h).unwrap();
    let now = Instant::now();
    let eps: Vec<Arc<EndpointState>> = [ep("a:1").kv_id(0, true), ep("b:1").kv_id(1, true)]
        .iter()
        .map(|e| e.build(now))
        .collect();
    let f = facts().with_tokens((0..96).collect::<Vec<u32>>(), true, vec![]);
    let keys = {
        let mut cycle = CycleState::new(f.clone(), now);
        (*cycle.block_keys(16).unwrap()).clone()
    };
    let held_by_a = || {
        h.kv_index
            .score(&keys, &[kvgate_kvcache::EndpointId(0)])
            .endpoints
            .first()
            .map_or(0, |e| e.matched_blocks)
    };
    let decisions = || s.metrics.decisions_value("single", "picked");
    let dry = s
        .dry_pick(&mut CycleState::new(f.clone(), now), &eps)
        .expect("a pick");
    assert_eq!(dry.name(), "b:1", "the holder");
    assert!(eps.iter().all(|e| e.in_flight_requests() == 0));
    assert_eq!(decisions(), 0, "not counted");
    let d = s
        .schedule(&mut CycleState::new(f.clone(), now), &eps)
        .unwrap();
    assert_eq!(d.endpoint().name(), dry.name(), "the same pick");
    assert_eq!(decisions(), 1);
    assert_eq!(d.endpoint().in_flight_requests(), 1);
    // The real pick made speculative holdings at b; a dry pick of the same facts while a
    // holds nothing leaves a without any.
    let a_only = [Arc::clone(&eps[0])];
    assert_eq!(
        s.dry_pick(&mut CycleState::new(f.clone(), now), &a_only)
            .map(|e| e.name().to_owned()),
        Some("a:1".to_owned())
    );
    assert_eq!(held_by_a(), 0, "no speculative holdings from a dry pick");
    assert_eq!(eps[0].in_flight_requests(), 0);

    let pd = Scheduler::from_config(&SchedulerConfig::from_yaml(PD).unwrap(), &h).unwrap();
    let pd_eps: Vec<Arc<EndpointState>> = [
        ep("a:1").label(ROLE_LABEL, "decode").kv_id(0, true),
        ep("p:1").label(ROLE_LABEL, "prefill").waiting(0.0),
    ]
    .iter()
    .map(|e| e.build(now))
    .collect();
    let long = facts().with_tokens((1000..1200).collect::<Vec<u32>>(), true, vec![]);
    assert!(
        pd.dry_pick(&mut CycleState::new(long.clone(), now), &pd_eps)
            .is_none(),
        "remote prefill: two runs, no single pick"
    );
    assert_eq!(
        pd.schedule(&mut CycleState::new(long, now), &pd_eps)
            .unwrap()
            .kind(),
        "prefill-decode",
        "the same facts do run two profiles"
    );
}

/// With a seed, a dry pick sees the seed the next cycle will get and leaves it to that cycle:
/// a seeded random picker's dry picks foretell its picks.
#[test]
fn a_seeded_dry_pick_foretells_the_next_pick() {
    let s = build("plugins:\n  - type: random-picker\nseed: 7\n").unwrap();
    let now = Instant::now();
    let eps: Vec<Arc<EndpointState>> = ["a:1", "b:1", "c:1", "d:1"]
        .iter()
        .map(|n| ep(n).build(now))
        .collect();
    let mut picks = Vec::new();
    for _ in 0..16 {
        let dry = s
            .dry_pick(&mut CycleState::new(facts(), now), &eps)
            .unwrap();
        let real = s
            .schedule(&mut CycleState::new(facts(), now), &eps)
            .unwrap();
        assert_eq!(dry.name(), real.endpoint().name());
        picks.push(dry.name().to_owned());
    }
    assert!(
        picks.iter().any(|p| *p != picks[0]),
        "random picks: {picks:?}"
    );
}

/// The counters a scheduler keeps are the families' own series: two schedulers on one set of
/// families (a reload) count into the same `picks` and `decisions` series, by profile and
/// endpoint.
#[test]
fn kept_counters_count_into_the_families() {
    let mut registry = prometheus_client::registry::Registry::default();
    let h = SchedulerHandles {
        metrics: ScheduleMetrics::new(&mut registry),
        ..handles(false)
    };
    let first = Scheduler::from_config(&SchedulerConfig::default(), &h).unwrap();
    let reloaded = Scheduler::from_config(&SchedulerConfig::default(), &h).unwrap();
    let mut picked = std::collections::HashMap::<String, u64>::new();
    for (i, s) in [&first, &first, &reloaded, &first, &reloaded]
        .into_iter()
        .enumerate()
    {
        let eps = [ep("a:1"), ep("b:1"), ep("c:1")];
        let only = &eps[i % 2..i % 2 + 2];
        let d = schedule(s, only, facts()).unwrap();
        *picked.entry(d.endpoint().name().to_owned()).or_default() += 1;
    }
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let value = |prefix: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    };
    assert!(
        picked.len() > 1,
        "picks went to more than one endpoint: {picked:?}"
    );
    for (endpoint, n) in &picked {
        let series =
            format!("kvgate_schedule_picks_total{{profile=\"default\",endpoint=\"{endpoint}\"}}");
        assert_eq!(value(&series), *n, "{series}\n{text}");
    }
    let decisions = "kvgate_schedule_decisions_total{kind=\"single\",outcome=\"picked\"}";
    assert_eq!(value(decisions), 5, "{text}");
    assert_eq!(
        value("kvgate_schedule_decision_duration_seconds_count"),
        5,
        "{text}"
    );
}
