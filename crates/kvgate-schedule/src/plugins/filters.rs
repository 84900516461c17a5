//! Built-in filters, one per file.

pub mod label_selector_filter;
pub mod model_filter;
pub mod role_filter;
pub mod utilization_filter;
