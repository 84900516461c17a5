//! The YAML config: `kvgate.yaml` (`kvgate_proxy::FileConfig`, merged into a `ProxyConfig`;
//! with the default feature `full` only) and the scheduler section alone
//! (`SchedulerConfig::from_yaml`), each built into a `Scheduler` when it parses. Any text:
//! an error or a config, never a panic.
#![no_main]

use std::sync::OnceLock;

use kvgate_kvcache::{IndexConfig, KvIndex, KvMetrics};
#[cfg(feature = "full")]
use kvgate_proxy::{FileConfig, ProxyConfig};
use kvgate_schedule::{ScheduleMetrics, Scheduler, SchedulerConfig, SchedulerHandles};
use libfuzzer_sys::fuzz_target;

/// One index and metrics set for the whole run (building them per input would only
/// measure the registry).
fn handles(precise: bool) -> SchedulerHandles {
    static BASE: OnceLock<(KvIndex, ScheduleMetrics)> = OnceLock::new();
    let (kv_index, metrics) = BASE.get_or_init(|| {
        let mut registry = prometheus_client::registry::Registry::default();
        let kv_index = KvIndex::new(IndexConfig::default(), KvMetrics::new(&mut registry));
        (kv_index, ScheduleMetrics::new(&mut registry))
    });
    SchedulerHandles {
        kv_index: kv_index.clone(),
        metrics: metrics.clone(),
        precise,
    }
}

fn build(config: &SchedulerConfig) {
    let precise = config.seed.is_some_and(|s| s % 2 == 1);
    if let Ok(scheduler) = Scheduler::from_config(config, &handles(precise)) {
        assert!(
            !scheduler.profile_names().is_empty(),
            "a scheduler has a profile"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    #[cfg(feature = "full")]
    if let Ok(file) = FileConfig::from_yaml(text) {
        let mut config = ProxyConfig::default();
        if config.merge_file(&file).is_ok() {
            build(&config.scheduler);
        }
    }
    if let Ok(config) = SchedulerConfig::from_yaml(text) {
        build(&config);
    }
});
