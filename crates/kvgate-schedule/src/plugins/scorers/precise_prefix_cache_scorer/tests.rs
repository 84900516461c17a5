use kvgate_kvcache::{BlockStored, EndpointKey, EndpointSpec, IndexConfig, KvEvent, KvMetrics};

use super::*;
use crate::cycle::RequestFacts;
use crate::test_util::{Ep, ep, facts, setup};

/// Index with a:1 holding blocks 0..4 on GPU and b:1 holding blocks 0..2 on CPU.
fn index() -> KvIndex {
    let index = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
    for a in ["a:1", "b:1", "c:1"] {
        index.register_endpoint(EndpointSpec {
            key: EndpointKey::new(a, 0),
            model: "m".into(),
            block_size: 16,
            capacity_blocks: None,
        });
    }
    let stored = |n: u32, medium: Option<&str>| {
        KvEvent::BlockStored(BlockStored {
            block_hashes: (1..=u64::from(n)).map(Into::into).collect(),
            token_ids: (0..n * 16).collect(),
            block_size: 16,
            medium: medium.map(str::to_owned),
            ..BlockStored::default()
        })
    };
    index.apply_event(kvgate_kvcache::EndpointId(0), &stored(4, None));
    index.apply_event(kvgate_kvcache::EndpointId(1), &stored(2, Some("CPU")));
    index
}

fn eps() -> Vec<Ep> {
    vec![
        ep("a:1").kv_id(0, true),
        ep("b:1").kv_id(1, true),
        ep("c:1").kv_id(2, true),
    ]
}

fn toks(n: u32, exact: bool) -> RequestFacts {
    facts().with_tokens((0..n).collect::<Vec<u32>>(), exact, vec![])
}

fn run(
    s: &PrecisePrefixCacheScorer,
    eps: &[Ep],
    f: RequestFacts,
) -> (Result<Vec<f64>, SkipReason>, Vec<u64>) {
    let (built, mut cycle) = setup(eps, f);
    let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
    let mut out = vec![0.0; refs.len()];
    let r = match s.score(&mut cycle, &refs, &mut out) {
        ScoreOutcome::Scored => Ok(out),
        ScoreOutcome::Skipped(r) => Err(r),
    };
    let pred = cycle
        .prefix_match()
        .map(|m| m.predicted.iter().map(|p| p.1).collect())
        .unwrap_or_default();
    (r, pred)
}

#[test]
fn table() {
    let index = index();
    let s =
        PrecisePrefixCacheScorer::new(PrecisePrefixCacheScorerConfig::default(), &index).unwrap();
    let blend = PrecisePrefixCacheScorer::new(
        PrecisePrefixCacheScorerConfig {
            match_length_weight: 0.5,
            match_length_scale_tokens: 128,
            speculative: false,
        },
        &index,
    )
    .unwrap();
    let no_events = vec![ep("a:1").kv_id(0, false), ep("b:1").kv_id(1, true)];
    type Row<'a> = (
        &'a str,
        &'a PrecisePrefixCacheScorer,
        Vec<Ep>,
        RequestFacts,
        Result<Vec<f64>, SkipReason>,
        Vec<u64>,
    );
    let cases: Vec<Row<'_>> = vec![
        (
            "full match, cpu tier weighted",
            &s,
            eps(),
            toks(64, true),
            Ok(vec![1.0, 0.4, 0.0]),
            vec![64, 32, 0],
        ),
        (
            "longer prompt halves",
            &s,
            eps(),
            toks(128, true),
            Ok(vec![0.5, 0.2, 0.0]),
            vec![64, 32, 0],
        ),
        (
            "partial tail ignored",
            &s,
            eps(),
            toks(70, true),
            Ok(vec![1.0, 0.4, 0.0]),
            vec![64, 32, 0],
        ),
        (
            "estimated tokens",
            &s,
            eps(),
            toks(64, false),
            Err(SkipReason::TokensNotExact),
            vec![],
        ),
        (
            "no tokens",
            &s,
            eps(),
            facts(),
            Err(SkipReason::NoTokens),
            vec![],
        ),
        (
            "short prompt",
            &s,
            eps(),
            toks(15, true),
            Err(SkipReason::NoFullBlock),
            vec![],
        ),
        (
            "endpoint without events",
            &s,
            no_events,
            toks(64, true),
            Ok(vec![0.0, 0.4]),
            vec![0, 32],
        ),
        (
            "all without events",
            &s,
            vec![ep("a:1").kv_id(0, false)],
            toks(64, true),
            Err(SkipReason::NoSignal),
            vec![],
        ),
        (
            "salted prompt misses",
            &s,
            eps(),
            RequestFacts {
                cache_salt: Some("x".into()),
                ..toks(64, true)
            },
            Ok(vec![0.0; 3]),
            vec![0, 0, 0],
        ),
        (
            "adapter misses",
            &s,
            eps(),
            toks(64, true).with_lora_adapter("ad"),
            Ok(vec![0.0; 3]),
            vec![0, 0, 0],
        ),
        (
            "match length blend",
            &blend,
            eps(),
            toks(64, true),
            Ok(vec![0.5 + 0.5 * 0.25, 0.2 + 0.5 * 0.0625, 0.0]),
            vec![64, 32, 0],
        ),
    ];
    for (name, s, eps, f, want, pred) in cases {
        let (got, got_pred) = run(s, &eps, f);
        assert_eq!(got, want, "{name}");
        assert_eq!(got_pred, pred, "{name} predicted");
    }
}

#[test]
fn speculative_after_pick() {
    let index = index();
    let s =
        PrecisePrefixCacheScorer::new(PrecisePrefixCacheScorerConfig::default(), &index).unwrap();
    let (built, mut cycle) = setup(&eps(), toks(64, true));
    s.after_pick(&mut cycle, &built[2]);
    assert_eq!(run(&s, &eps(), toks(64, true)).0, Ok(vec![1.0, 0.4, 1.0]));
    let off = PrecisePrefixCacheScorer::new(
        PrecisePrefixCacheScorerConfig {
            speculative: false,
            ..Default::default()
        },
        &index,
    )
    .unwrap();
    let (built, mut cycle) = setup(&eps(), toks(96, true));
    off.after_pick(&mut cycle, &built[2]);
    assert_eq!(
        run(&s, &eps(), toks(96, true)).0.unwrap()[2],
        4.0 / 6.0,
        "no insert when off"
    );
}

#[test]
fn bad_parameters_are_named() {
    let cases = [
        (
            "weight above 1",
            1.5,
            1,
            &["match_length_weight", "1.5"][..],
        ),
        (
            "zero scale",
            0.5,
            0,
            &["match_length_scale_tokens", "greater than 0"][..],
        ),
    ];
    for (name, match_length_weight, match_length_scale_tokens, words) in cases {
        let config = PrecisePrefixCacheScorerConfig {
            match_length_weight,
            match_length_scale_tokens,
            ..Default::default()
        };
        let e = PrecisePrefixCacheScorer::new(config, &index()).unwrap_err();
        for w in words {
            assert!(e.to_string().contains(w), "{name}: {e}");
        }
    }
}
