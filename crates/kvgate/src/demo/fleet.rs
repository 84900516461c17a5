//! The demo's engines: an in-process `kvgate sim` fleet, or the user's own engines.

use std::collections::HashMap;

use anyhow::Context;
use kvgate_sim::{BUNDLED_TOKENIZER, Sim, SimArgs};

/// Engines in the simulated fleet.
const INSTANCES: usize = 4;

/// What the routers route to and how to reset it between runs.
pub(crate) struct Engines {
    /// `endpoints:` (with KV events) and `models:` YAML; no `endpoints` for user engines.
    yaml_with_events: String,
    /// The same without KV events, for policies that must not see them.
    yaml_without_events: String,
    /// `--endpoint` flags of user engines.
    flags: Vec<String>,
    /// URLs to POST before each run to drop the prefix caches.
    pub(crate) reset: Vec<String>,
    /// The simulated fleet, when the demo started one.
    pub(crate) sim: Option<Sim>,
}

/// The simulator's latency model and KV capacity.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SimShape {
    /// KV blocks per engine.
    pub(crate) gpu_blocks: usize,
    /// Tokens per KV block.
    pub(crate) block_size: usize,
    /// Prefill speed in tokens per second.
    pub(crate) prefill_tokens_per_s: f64,
    /// Fixed cost of a prefill step, in milliseconds.
    pub(crate) prefill_base_ms: f64,
    /// Inter-token latency, in milliseconds.
    pub(crate) itl_ms: f64,
}

impl Engines {
    /// Starts `INSTANCES` simulated engines serving `model` with the bundled tokenizer.
    ///
    /// # Errors
    /// When the simulator cannot start (bad flags, ports, tokenizer).
    pub(crate) async fn simulated(model: &str, shape: SimShape) -> anyhow::Result<Engines> {
        let args = sim_args(model, shape)?;
        let sim = kvgate_sim::start(&args, &HashMap::<String, String>::new())
            .await
            .context("starting the simulated fleet")?;
        let mut yaml = String::from("endpoints:\n");
        let mut plain = yaml.clone();
        let mut reset = Vec::new();
        for inst in sim.instances() {
            let entry = format!("  - url: http://{}\n    model: {model}\n", inst.http);
            plain += &entry;
            yaml += &entry;
            if let Some(ev) = inst.events.first() {
                yaml += &format!("    kv_events: {}\n", ev.events);
                if let Some(replay) = &ev.replay {
                    yaml += &format!("    kv_replay: {replay}\n");
                }
            }
            reset.push(format!("http://{}", inst.http));
        }
        yaml += &models_yaml(model, true);
        plain += &models_yaml(model, true);
        Ok(Engines {
            yaml_with_events: yaml,
            yaml_without_events: plain,
            flags: Vec::new(),
            reset,
            sim: Some(sim),
        })
    }

    /// The user's engines (`URL[,kv=…]` flags), reset through `reset` URLs.
    pub(crate) fn external(model: &str, flags: Vec<String>, reset: Vec<String>) -> Engines {
        Engines {
            yaml_with_events: models_yaml(model, false),
            yaml_without_events: models_yaml(model, false),
            flags,
            reset,
            sim: None,
        }
    }

    /// The `endpoints:`/`models:` YAML, with or without KV-event sockets.
    pub(crate) fn yaml(&self, kv_events: bool) -> &str {
        if kv_events {
            &self.yaml_with_events
        } else {
            &self.yaml_without_events
        }
    }

    /// The user's `--endpoint` flags, without `kv=`/`replay=` options unless `kv_events`.
    pub(crate) fn flags(&self, kv_events: bool) -> Vec<String> {
        self.flags
            .iter()
            .map(|flag| {
                flag.split(',')
                    .filter(|part| {
                        kv_events || !(part.starts_with("kv=") || part.starts_with("replay="))
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .collect()
    }

    /// Stops the simulated fleet, if any.
    pub(crate) async fn shutdown(self) {
        if let Some(sim) = self.sim {
            sim.shutdown().await;
        }
    }
}

/// `models:` YAML for `model`, with the bundled tokenizer when `bundled`.
fn models_yaml(model: &str, bundled: bool) -> String {
    let mut yaml = format!("models:\n  - name: {model}\n");
    if bundled {
        yaml += &format!("    tokenizer: {{ local: {BUNDLED_TOKENIZER} }}\n");
    }
    yaml
}

/// The sim flags: loopback, free ports, KV events with replay, and `shape`.
fn sim_args(model: &str, shape: SimShape) -> anyhow::Result<SimArgs> {
    let flags = [
        ("--model", model.to_owned()),
        ("--instances", INSTANCES.to_string()),
        ("--num-gpu-blocks", shape.gpu_blocks.to_string()),
        ("--block-size", shape.block_size.to_string()),
        (
            "--prefill-tokens-per-s",
            shape.prefill_tokens_per_s.to_string(),
        ),
        ("--prefill-base-ms", shape.prefill_base_ms.to_string()),
        ("--itl-ms", shape.itl_ms.to_string()),
    ];
    SimArgs::loopback(
        flags
            .into_iter()
            .flat_map(|(flag, value)| [flag.to_owned(), value]),
    )
    .context("building the simulator flags")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_drop_event_options_unless_asked() {
        let e = Engines::external(
            "m",
            vec!["http://a:8000,kv=tcp://a:5557,replay=tcp://a:5558,model=m".to_owned()],
            Vec::new(),
        );
        let cases = [
            (
                true,
                "http://a:8000,kv=tcp://a:5557,replay=tcp://a:5558,model=m",
            ),
            (false, "http://a:8000,model=m"),
        ];
        for (events, want) in cases {
            assert_eq!(e.flags(events), vec![want.to_owned()], "{events}");
        }
    }
}
