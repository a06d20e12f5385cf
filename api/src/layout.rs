//! The flat parameter vector: a deterministic layout of named tensors, its
//! split into shard ranges, and its initial values. Every role computes the
//! same layout from the same model spec.

use std::ops::Range;

use crate::spec::{Activation, Loss, ModelSpec};

pub mod image;
mod partition;
mod tables;
pub use image::{ImageLayer, ImageOp, MapShape};
pub use partition::{Block, ImageBlock, Partitioning};
pub(crate) use tables::embedding_width;
pub use tables::{KeyedTable, LIBSVM_FIELD, Tables, WIDE_TABLE, categorical_fields};

/// One named tensor inside the flat parameter vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
}

impl Tensor {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len()
    }
}

/// One dense layer as stored in the flat vector: `weight` is
/// `[inputs, units]` row-major, `bias` is `[units]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenseShape {
    pub inputs: usize,
    pub units: usize,
    pub activation: Activation,
    pub weight: Range<usize>,
    pub bias: Range<usize>,
}

/// One DCN-v2 cross layer: `weight` is `[dim, dim]` row-major, `bias` is
/// `[dim]`; it maps x to x₀ ⊙ (x·weight + bias) + x.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrossShape {
    pub dim: usize,
    pub weight: Range<usize>,
    pub bias: Range<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub tensors: Vec<Tensor>,
    /// Image layers (conv2d, locallyConnected2d, pooling), run first.
    pub image: Vec<ImageLayer>,
    /// Cross layers over the flat input, run before the dense layers.
    pub cross: Vec<CrossShape>,
    /// Dense layers, the output layer last.
    pub layers: Vec<DenseShape>,
    /// Features per example the model reads (the tables' rows included).
    inputs: usize,
    /// The loss the output layer's logits go to.
    pub loss: Loss,
    len: usize,
}

impl Layout {
    /// Tensors in layer order, weight before bias. The output layer is linear:
    /// its logits go to the loss. The first layer takes the numeric
    /// features, then each table's rows (tables in order, fields in the
    /// table's order).
    ///
    /// Panics on a model [`validate`](crate::validate) refuses; see
    /// [`Layout::try_from_model`].
    pub fn from_model(model: &ModelSpec) -> Layout {
        Layout::try_from_model(model).unwrap_or_else(|e| panic!("{}: {}", e.field, e.message))
    }

    /// The layout, or the first layer whose shape does not fit its input.
    /// Image layers' tensors come first, then the cross layers', then the
    /// dense layers'.
    pub fn try_from_model(model: &ModelSpec) -> Result<Layout, image::LayerError> {
        let all_inputs = model.input_size as usize + tables::embedding_width(model) as usize;
        let resolved = image::resolve(model, all_inputs)?;
        let mut tensors = resolved.tensors;
        let mut layers = Vec::new();
        let mut offset = tensors.last().map_or(0, |t| t.offset + t.len());
        let mut inputs = resolved.flat_inputs;
        let mut cross = Vec::new();
        for i in 0..model.cross.map_or(0, |c| c.layers as usize) {
            let (weight, bias) = push_linear(
                &mut tensors,
                &mut offset,
                &format!("cross{i}"),
                inputs,
                inputs,
            );
            cross.push(CrossShape {
                dim: inputs,
                weight,
                bias,
            });
        }
        let dims = resolved
            .dense
            .iter()
            .map(|l| (l.units as usize, l.activation))
            .chain(std::iter::once((
                model.output.units as usize,
                Activation::Linear,
            )));
        for (i, (units, activation)) in dims.enumerate() {
            let (weight, bias) = push_linear(
                &mut tensors,
                &mut offset,
                &format!("dense{i}"),
                inputs,
                units,
            );
            layers.push(DenseShape {
                inputs,
                units,
                activation,
                weight,
                bias,
            });
            inputs = units;
        }
        Ok(Layout {
            tensors,
            image: resolved.image,
            cross,
            layers,
            inputs: all_inputs,
            loss: model.output.loss,
            len: offset,
        })
    }

    /// Number of f32 parameters.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn classes(&self) -> usize {
        self.layers.last().map_or(0, |l| l.units)
    }

    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// Values one example's activations take, over every layer.
    pub fn activations(&self) -> usize {
        self.image.iter().map(|l| l.output.len()).sum::<usize>()
            + 2 * self.cross.iter().map(|c| c.dim).sum::<usize>()
            + self.layers.iter().map(|l| l.units).sum::<usize>()
    }

    /// Contiguous ranges, one per shard, whose sizes differ by at most one.
    pub fn shard_ranges(&self, shards: usize) -> Vec<Range<usize>> {
        shard_ranges(self.len, shards)
    }

    /// Initial values of `range`: uniform Glorot for linear, tanh and sigmoid
    /// layers, uniform He for relu, zero biases. Each value depends only on
    /// the seed and its index, so a shard can initialise its own range alone.
    pub fn initial_values(&self, range: Range<usize>, seed: u64) -> Vec<f32> {
        let mut out = vec![0.0; range.len()];
        // (weights, activation, fan in, fan out) of every layer with weights.
        let convs = self.image.iter().filter_map(|l| match &l.op {
            ImageOp::Conv { kernel, .. } => Some((
                kernel,
                l.activation,
                l.patch(),
                l.output.channels * l.window.size * l.window.size,
            )),
            _ => None,
        });
        let dense = self
            .layers
            .iter()
            .map(|l| (&l.weight, l.activation, l.inputs, l.units));
        // Cross layers start at zero: each passes its input through
        // (x₀ ⊙ 0 + x), so the model starts as the one without them and
        // learns its interactions from there.
        for (w, activation, fan_in, fan_out) in convs.chain(dense) {
            let lo = w.start.max(range.start);
            let hi = w.end.min(range.end);
            if lo >= hi {
                continue;
            }
            let limit = match activation {
                Activation::Relu => (6.0 / fan_in as f64).sqrt(),
                _ => (6.0 / (fan_in + fan_out) as f64).sqrt(),
            };
            for i in lo..hi {
                out[i - range.start] = (limit * (2.0 * unit_uniform(seed, i as u64) - 1.0)) as f32;
            }
        }
        out
    }
}

/// Adds `<name>/weight` (`[inputs, units]`) and `<name>/bias` (`[units]`)
/// at `offset`, moving it past them; their ranges.
fn push_linear(
    tensors: &mut Vec<Tensor>,
    offset: &mut usize,
    name: &str,
    inputs: usize,
    units: usize,
) -> (Range<usize>, Range<usize>) {
    let mut ranges = Vec::with_capacity(2);
    for (part, shape) in [("weight", vec![inputs, units]), ("bias", vec![units])] {
        let t = Tensor {
            name: format!("{name}/{part}"),
            shape,
            offset: *offset,
        };
        *offset += t.len();
        ranges.push(t.range());
        tensors.push(t);
    }
    (ranges[0].clone(), ranges[1].clone())
}

/// Splits `[0, len)` into `shards` contiguous ranges whose sizes differ by at most one.
pub fn shard_ranges(len: usize, shards: usize) -> Vec<Range<usize>> {
    let shards = shards.max(1);
    let base = len / shards;
    let extra = len % shards;
    let mut start = 0;
    (0..shards)
        .map(|s| {
            let size = base + usize::from(s < extra);
            let r = start..start + size;
            start += size;
            r
        })
        .collect()
}

/// A uniform value in [0, 1) from (seed, index), via splitmix64.
fn unit_uniform(seed: u64, index: u64) -> f64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(index)
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{DenseLayer, Loss, OutputLayer};

    fn mlp() -> ModelSpec {
        ModelSpec {
            tables: Vec::new(),
            wide: None,
            cross: None,
            dot_interaction: false,
            input_size: 784,
            input_shape: None,
            layers: Vec::new(),
            hidden: vec![DenseLayer {
                units: 512,
                activation: Activation::Relu,
            }],
            output: OutputLayer {
                units: 10,
                loss: Loss::SoftmaxCrossEntropy,
            },
        }
    }

    /// Cross layers' tensors come before the dense ones, and the one
    /// partition and the shards cover all of them.
    #[test]
    fn cross_layers_are_stored_first_and_covered_by_the_shards() {
        let mut m = mlp();
        m.input_size = 6;
        m.cross = Some(crate::spec::CrossSpec { layers: 2 });
        let l = Layout::from_model(&m);
        let names: Vec<_> = l.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names[..4],
            [
                "cross0/weight",
                "cross0/bias",
                "cross1/weight",
                "cross1/bias"
            ]
        );
        assert_eq!(l.len(), 2 * (36 + 6) + 6 * 512 + 512 + 512 * 10 + 10);
        let p = Partitioning::new(&l, 1);
        assert_eq!(p.range(0), 0..l.len());
        assert_eq!(p.blocks(0)[0].weight.start, 2 * (36 + 6));
        assert_eq!(p.shard_ranges(2).last().unwrap().end, l.len());
    }

    #[test]
    fn mlp_layout_is_dense_and_ordered() {
        let l = Layout::from_model(&mlp());
        assert_eq!(l.len(), 784 * 512 + 512 + 512 * 10 + 10);
        let names: Vec<_> = l.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "dense0/weight",
                "dense0/bias",
                "dense1/weight",
                "dense1/bias"
            ]
        );
        let mut expected = 0;
        for t in &l.tensors {
            assert_eq!(t.offset, expected, "{} is not contiguous", t.name);
            expected += t.len();
        }
        assert_eq!(l.layers[1].activation, Activation::Linear);
        assert_eq!((l.inputs(), l.classes()), (784, 10));
    }

    #[test]
    fn shard_ranges_cover_and_balance() {
        for (len, shards) in [(10, 3), (407_050, 2), (5, 5), (7, 1), (100, 7)] {
            let r = shard_ranges(len, shards);
            assert_eq!(r.len(), shards);
            assert_eq!(r[0].start, 0);
            assert_eq!(r.last().unwrap().end, len);
            for w in r.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            let sizes: Vec<_> = r.iter().map(|x| x.len()).collect();
            let (mn, mx) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(mx - mn <= 1, "{sizes:?}");
        }
    }

    #[test]
    fn sharded_init_equals_whole_init() {
        let l = Layout::from_model(&mlp());
        let whole = l.initial_values(0..l.len(), 7);
        let mut joined = Vec::new();
        for r in l.shard_ranges(3) {
            joined.extend(l.initial_values(r, 7));
        }
        assert_eq!(whole, joined);
        assert_ne!(whole, l.initial_values(0..l.len(), 8));
        let w = &l.layers[0].weight;
        let limit = (6.0f32 / 784.0).sqrt();
        assert!(whole[w.clone()].iter().all(|v| v.abs() <= limit));
        let mean: f32 = whole[w.clone()].iter().sum::<f32>() / w.len() as f32;
        assert!(mean.abs() < 0.01);
        assert!(whole[l.layers[0].bias.clone()].iter().all(|&v| v == 0.0));
    }
}
