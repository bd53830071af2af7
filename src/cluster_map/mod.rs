//! The cluster map: every node a row of GPU cells, coloured by the instance
//! and shard holding each device and marked when unhealthy, too hot,
//! excluded or held outside tessera; and each instance's plan, predictions,
//! capacity curves, conditions and last events. The controller serves it live from its
//! caches; `tessera place -o html` writes it for a plan.

mod capacity_chart;
mod instance_section;
mod links;
mod model;
mod page;

pub(crate) use model::{
    ClusterView, Curve, MapCondition, MapEvent, MapInstance, MapNode, Prediction,
};
pub(crate) use page::{cluster_page, instance_page};
