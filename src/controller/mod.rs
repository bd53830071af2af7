//! The controller's pure side: translating Nodes and ModelInstances into the
//! solver's problem and its plan back into status.

pub mod problem;
