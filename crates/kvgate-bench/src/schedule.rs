//! Arrivals: when each conversation starts.
//!
//! - [`Arrival::Poisson`]: open loop. New conversations arrive at rate λ per second with
//!   exponential gaps, whether or not earlier ones have finished. Conversations of one
//!   cohort (burst siblings) arrive together, so λ counts cohorts.
//! - [`Arrival::Closed`]: closed loop. C workers each run one conversation at a time and
//!   take the next as soon as theirs completes.
//! - [`Arrival::Trace`]: open loop at the recorded offsets of a replay trace, divided by a
//!   speed factor.
//!
//! A [`Schedule`] is computed once from the seed, so two runs of one workload (say, engine
//! direct and through the router) see the same arrival instants.

use std::{collections::HashMap, time::Duration};

use crate::{BenchError, Workload, text::Rng};

/// How conversations arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    /// Open loop at `rate` conversations (cohorts) per second.
    Poisson {
        /// λ, in arrivals per second.
        rate: f64,
    },
    /// Closed loop with `concurrency` conversations in flight.
    Closed {
        /// C, the number of workers.
        concurrency: usize,
    },
    /// Open loop at the trace's recorded times, `speed` times faster.
    Trace {
        /// 1.0 replays in real time; 2.0 twice as fast.
        speed: f64,
    },
}

/// The arrival plan for one workload.
#[derive(Debug, Clone, PartialEq)]
pub enum Schedule {
    /// Start offsets from the run's start, one per conversation (same order).
    Open(Vec<Duration>),
    /// Number of closed-loop workers.
    Closed(usize),
}

impl Schedule {
    /// Computes the schedule of `workload` under `arrival`, drawing Poisson gaps from `seed`.
    ///
    /// # Errors
    /// [`BenchError::InvalidArgument`] for a non-positive rate, speed or concurrency.
    pub fn build(arrival: Arrival, workload: &Workload, seed: u64) -> Result<Self, BenchError> {
        match arrival {
            Arrival::Closed { concurrency } => {
                if concurrency == 0 {
                    return Err(BenchError::InvalidArgument(
                        "concurrency must be at least 1".into(),
                    ));
                }
                Ok(Self::Closed(concurrency))
            }
            Arrival::Poisson { rate } => {
                if !(rate.is_finite() && rate > 0.0) {
                    return Err(BenchError::InvalidArgument(format!(
                        "rate {rate} must be a positive number of arrivals per second"
                    )));
                }
                let mut rng = Rng::new(seed, 0x5C4E_D01E);
                let mut now = 0.0;
                let mut first = true;
                let mut cohorts: HashMap<u32, Duration> = HashMap::new();
                let offsets = workload
                    .conversations
                    .iter()
                    .map(|c| {
                        *cohorts.entry(c.cohort).or_insert_with(|| {
                            if !first {
                                // Exponential gap: -ln(U)/λ with U in (0, 1].
                                now += -(1.0 - rng.next_f64()).ln() / rate;
                            }
                            first = false;
                            Duration::from_secs_f64(now)
                        })
                    })
                    .collect();
                Ok(Self::Open(offsets))
            }
            Arrival::Trace { speed } => {
                if !(speed.is_finite() && speed > 0.0) {
                    return Err(BenchError::InvalidArgument(format!(
                        "trace speed {speed} must be positive"
                    )));
                }
                Ok(Self::Open(
                    workload
                        .conversations
                        .iter()
                        .map(|c| c.at.unwrap_or_default().div_f64(speed))
                        .collect(),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BodyOptions, Burst, LowReuse};

    #[test]
    fn poisson_is_seeded_and_has_the_asked_mean_rate() {
        let w = LowReuse {
            requests: 4000,
            prompt_tokens: 2,
        }
        .generate(&BodyOptions::default(), 0);
        let a = Schedule::build(Arrival::Poisson { rate: 100.0 }, &w, 1).unwrap();
        let b = Schedule::build(Arrival::Poisson { rate: 100.0 }, &w, 1).unwrap();
        let c = Schedule::build(Arrival::Poisson { rate: 100.0 }, &w, 2).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        let Schedule::Open(offsets) = a else {
            panic!("open")
        };
        assert_eq!(offsets[0], Duration::ZERO);
        assert!(offsets.windows(2).all(|p| p[0] <= p[1]), "non-decreasing");
        let rate = (offsets.len() - 1) as f64 / offsets.last().unwrap().as_secs_f64();
        assert!((80.0..120.0).contains(&rate), "realized rate {rate}");
    }

    #[test]
    fn cohorts_arrive_together() {
        let w = Burst {
            bursts: 3,
            siblings: 4,
            prompt_tokens: 4,
        }
        .generate(&BodyOptions::default(), 0);
        let Schedule::Open(offsets) =
            Schedule::build(Arrival::Poisson { rate: 10.0 }, &w, 7).unwrap()
        else {
            panic!("open")
        };
        for burst in offsets.chunks(4) {
            assert!(burst.iter().all(|t| *t == burst[0]));
        }
        assert!(offsets[0] < offsets[4] && offsets[4] < offsets[8]);
    }

    #[test]
    fn rejects_bad_parameters() {
        let w = LowReuse::default().generate(&BodyOptions::default(), 0);
        let cases = [
            ("zero rate", Arrival::Poisson { rate: 0.0 }, "rate 0 must"),
            (
                "nan rate",
                Arrival::Poisson { rate: f64::NAN },
                "rate NaN must",
            ),
            (
                "zero workers",
                Arrival::Closed { concurrency: 0 },
                "concurrency must",
            ),
            (
                "zero speed",
                Arrival::Trace { speed: 0.0 },
                "trace speed 0 must",
            ),
        ];
        for (name, arrival, field) in cases {
            let err = Schedule::build(arrival, &w, 0).map(|_| ()).expect_err(name);
            assert!(err.to_string().contains(field), "{name}: {err}");
        }
    }
}
