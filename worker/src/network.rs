//! What a replica computes with: the whole model, or its partition of a
//! model-parallel replica together with the exchange to its peers.

use std::time::Duration;

use distbelief_model::exchange::ExchangeError;
use distbelief_model::partition::PartitionScratch;
use distbelief_model::{Mlp, PartitionedMlp};
use ndarray::ArrayView2;

use crate::partitions::GrpcExchange;

/// The model a replica computes with: whole, or one partition of it.
pub(crate) enum Net {
    Whole(Mlp),
    Part {
        mlp: Box<PartitionedMlp>,
        exchange: GrpcExchange,
    },
}

/// Per-thread working memory for [`Net`].
pub(crate) enum Scratch {
    Whole(Vec<distbelief_model::mlp::Workspace>),
    Part(Box<PartitionScratch>),
}

impl Net {
    /// Time spent waiting on peer partitions so far.
    pub(crate) fn waited(&self) -> Duration {
        match self {
            Net::Whole(_) => Duration::ZERO,
            Net::Part { exchange, .. } => exchange.waited,
        }
    }

    pub(crate) fn scratch(&self, batch: usize, threads: usize) -> Scratch {
        match self {
            Net::Whole(m) => Scratch::Whole(m.workspaces(batch, threads)),
            Net::Part { mlp, .. } => Scratch::Part(Box::new(mlp.scratch(batch, threads))),
        }
    }

    /// Adds the batch's mean gradient into `grad`; returns the mean loss.
    pub(crate) fn gradient(
        &mut self,
        params: &[f32],
        x: ArrayView2<f32>,
        y: &[u32],
        scratch: &mut Scratch,
        step: u64,
        grad: &mut [f32],
    ) -> Result<f64, ExchangeError> {
        match (self, scratch) {
            (Net::Whole(m), Scratch::Whole(ws)) => Ok(m.batch_gradient(params, x, y, ws, grad)),
            (Net::Part { mlp, exchange }, Scratch::Part(s)) => {
                mlp.batch_gradient(params, x, y, s, exchange, step, grad)
            }
            _ => unreachable!("scratch is made by the same Net"),
        }
    }

    /// The exchange to the peer partitions, if this is one.
    pub(crate) fn exchange(&mut self) -> Option<&mut GrpcExchange> {
        match self {
            Net::Whole(_) => None,
            Net::Part { exchange, .. } => Some(exchange),
        }
    }
}
