//! What a running replica serves, measured: its runtime's Prometheus
//! exposition read ([`Scrape`]), scrapes kept over a sliding [`Window`], and
//! what a window says ([`Measurement`]), shown as the status's
//! [`MeasuredServing`](crate::api::MeasuredServing); and what the serving
//! model is found off by ([`correction`]). Pure: the controller fetches the
//! expositions.

pub mod correction;
mod exposition;
mod histogram;
mod names;
mod window;

pub use exposition::{Scrape, ScrapeError};
pub use window::{Measurement, Window};
