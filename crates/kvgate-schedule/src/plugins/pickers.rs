//! Built-in pickers, one per file.

pub mod max_score_picker;
pub mod random_picker;
pub mod round_robin_picker;
pub mod weighted_random_picker;
