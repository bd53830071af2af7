//! What a running replica serves, measured: its runtime's Prometheus
//! exposition read ([`Scrape`]), scrapes kept over a sliding [`Window`], and
//! what a window says ([`Measurement`]), shown as the status's
//! [`MeasuredServing`](crate::api::MeasuredServing); and what the serving
//! model is found off by ([`correction`]), and the demand a measured-demand
//! instance is planned for ([`demand`]). Pure: the controller fetches the
//! expositions.

pub mod correction;
pub mod demand;
mod exposition;
mod histogram;
mod names;
mod window;

pub use exposition::{Scrape, ScrapeError};
pub use window::{Measurement, Window};

/// `x` to `digits` significant figures (0 and non-finite as they are).
fn significant(x: f64, digits: i32) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let scale = 10f64.powi(digits - 1 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}
