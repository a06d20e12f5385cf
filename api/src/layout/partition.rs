//! Model parallelism's split of the parameter vector. Each of P partitions
//! owns a slice of every layer's output, and the parameters that produce it:
//! * a dense layer's units (weight columns and biases);
//! * a conv2d's filters (kernel columns and biases);
//! * a locallyConnected2d's output rows, as DistBelief split its layers
//!   spatially (those rows' kernels and biases);
//! * a pooling layer follows its input's split: the same channels, or the
//!   output rows whose windows start in the partition's input rows.
//!
//! The shards store the parameters partition by partition, so that each
//! partition's parameters are one contiguous range, and each shard holds the
//! parameters of exactly one partition. Within a partition a layer's weight
//! slice is `[inputs, units of the slice]` (a conv2d's `[patch, filters of
//! the slice]`), row-major, followed by its bias slice; a locallyConnected2d's
//! slice is its rows of the layout's tensors. With one partition this is the
//! model's own layout, unchanged.

use std::ops::Range;

use super::{ImageOp, Layout, shard_ranges};

/// One partition's slice of one layer, at offsets in the stored vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The layer's units (output columns) this slice produces.
    pub units: Range<usize>,
    /// `[inputs, units.len()]`, row-major.
    pub weight: Range<usize>,
    pub bias: Range<usize>,
}

/// One partition's share of one image layer's output map: the rows and
/// channels it computes (every column), and the parameters that make them,
/// at offsets in the stored vector (empty for pooling).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageBlock {
    pub rows: Range<usize>,
    pub channels: Range<usize>,
    pub kernel: Range<usize>,
    pub bias: Range<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partitioning {
    /// `image[p][i]`: partition p's share of image layer i.
    image: Vec<Vec<ImageBlock>>,
    /// `blocks[p][l]`: partition p's slice of dense layer l.
    blocks: Vec<Vec<Block>>,
    /// Partition p's contiguous range of the stored vector.
    ranges: Vec<Range<usize>>,
}

/// A stretch that is contiguous in both orders.
#[derive(Debug, Clone, Copy)]
struct Run {
    stored: usize,
    canonical: usize,
    len: usize,
}

impl Partitioning {
    /// Splits every layer's output into `parts` near-equal slices.
    pub fn new(layout: &Layout, parts: usize) -> Self {
        let parts = parts.max(1);
        let mut image = Vec::with_capacity(parts);
        let mut blocks = Vec::with_capacity(parts);
        let mut ranges = Vec::with_capacity(parts);
        let mut offset = 0;
        let image_splits = image_splits(layout, parts);
        let splits: Vec<Vec<Range<usize>>> = layout
            .layers
            .iter()
            .map(|l| shard_ranges(l.units, parts))
            .collect();
        for p in 0..parts {
            let start = offset;
            let mut own_image = Vec::with_capacity(layout.image.len());
            for (layer, split) in layout.image.iter().zip(&image_splits) {
                let (rows, channels) = split[p].clone();
                let (kernel, bias) = match layer.op {
                    ImageOp::Conv { tied: true, .. } => {
                        (layer.patch() * channels.len(), channels.len())
                    }
                    ImageOp::Conv { tied: false, .. } => {
                        let per_row = layer.output.width * channels.len();
                        (rows.len() * per_row * layer.patch(), rows.len() * per_row)
                    }
                    _ => (0, 0),
                };
                let kernel = offset..offset + kernel;
                let bias = kernel.end..kernel.end + bias;
                offset = bias.end;
                own_image.push(ImageBlock {
                    rows,
                    channels,
                    kernel,
                    bias,
                });
            }
            image.push(own_image);
            // Cross layers mix every input with every other, so they are
            // never split (validation keeps them to one partition); their
            // parameters come before the dense layers'.
            if parts == 1 {
                offset += layout
                    .cross
                    .iter()
                    .map(|c| c.weight.len() + c.bias.len())
                    .sum::<usize>();
            }
            let mut own = Vec::with_capacity(layout.layers.len());
            for (layer, split) in layout.layers.iter().zip(&splits) {
                let units = split[p].clone();
                let weight = offset..offset + layer.inputs * units.len();
                let bias = weight.end..weight.end + units.len();
                offset = bias.end;
                own.push(Block {
                    units,
                    weight,
                    bias,
                });
            }
            blocks.push(own);
            ranges.push(start..offset);
        }
        Partitioning {
            image,
            blocks,
            ranges,
        }
    }

    pub fn parts(&self) -> usize {
        self.ranges.len()
    }

    /// Partition `p`'s range of the stored vector.
    pub fn range(&self, p: usize) -> Range<usize> {
        self.ranges[p].clone()
    }

    /// Partition `p`'s slice of each dense layer.
    pub fn blocks(&self, p: usize) -> &[Block] {
        &self.blocks[p]
    }

    /// Partition `p`'s share of each image layer.
    pub fn image_blocks(&self, p: usize) -> &[ImageBlock] {
        &self.image[p]
    }

    /// Each shard's range of the stored vector: every partition's range is
    /// split into `shards / parts` near-equal pieces, so no shard crosses a
    /// partition boundary. Validation makes `shards` a multiple of the
    /// partitions; otherwise the vector is split evenly.
    pub fn shard_ranges(&self, shards: usize) -> Vec<Range<usize>> {
        let parts = self.parts();
        let len = self.ranges.last().map_or(0, |r| r.end);
        if parts == 1 || !shards.is_multiple_of(parts) {
            return shard_ranges(len, shards);
        }
        self.ranges
            .iter()
            .flat_map(|r| {
                shard_ranges(r.len(), shards / parts)
                    .into_iter()
                    .map(move |s| s.start + r.start..s.end + r.start)
            })
            .collect()
    }

    /// The shards (by index) that hold partition `p`'s parameters.
    pub fn shards_of(&self, p: usize, shards: usize) -> Range<usize> {
        let per = (shards / self.parts()).max(1);
        p * per..(p + 1) * per
    }

    fn runs(&self, layout: &Layout) -> Vec<Run> {
        if self.parts() == 1 {
            return vec![Run {
                stored: 0,
                canonical: 0,
                len: layout.len(),
            }];
        }
        let mut runs = Vec::new();
        for own_image in &self.image {
            for (layer, b) in layout.image.iter().zip(own_image) {
                let ImageOp::Conv { tied, kernel, bias } = &layer.op else {
                    continue;
                };
                let filters = layer.output.channels;
                if *tied {
                    let w = b.channels.len();
                    for i in 0..layer.patch() {
                        runs.push(Run {
                            stored: b.kernel.start + i * w,
                            canonical: kernel.start + i * filters + b.channels.start,
                            len: w,
                        });
                    }
                    runs.push(Run {
                        stored: b.bias.start,
                        canonical: bias.start + b.channels.start,
                        len: w,
                    });
                } else {
                    // Whole output rows: contiguous in both orders.
                    let row = layer.output.width * filters;
                    runs.push(Run {
                        stored: b.kernel.start,
                        canonical: kernel.start + b.rows.start * row * layer.patch(),
                        len: b.kernel.len(),
                    });
                    runs.push(Run {
                        stored: b.bias.start,
                        canonical: bias.start + b.rows.start * row,
                        len: b.bias.len(),
                    });
                }
            }
        }
        for own in &self.blocks {
            for (layer, b) in layout.layers.iter().zip(own) {
                let w = b.units.len();
                for i in 0..layer.inputs {
                    runs.push(Run {
                        stored: b.weight.start + i * w,
                        canonical: layer.weight.start + i * layer.units + b.units.start,
                        len: w,
                    });
                }
                runs.push(Run {
                    stored: b.bias.start,
                    canonical: layer.bias.start + b.units.start,
                    len: w,
                });
            }
        }
        runs
    }

    /// The layout's order from the stored order.
    pub fn to_canonical(&self, layout: &Layout, stored: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; stored.len()];
        for r in self.runs(layout) {
            out[r.canonical..r.canonical + r.len]
                .copy_from_slice(&stored[r.stored..r.stored + r.len]);
        }
        out
    }

    /// The stored order from the layout's order.
    pub fn to_stored(&self, layout: &Layout, canonical: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; canonical.len()];
        for r in self.runs(layout) {
            out[r.stored..r.stored + r.len]
                .copy_from_slice(&canonical[r.canonical..r.canonical + r.len]);
        }
        out
    }

    /// The initial values of `range` of the stored vector: the same model,
    /// value for value, as the unpartitioned job starts from.
    pub fn initial_values(&self, layout: &Layout, range: Range<usize>, seed: u64) -> Vec<f32> {
        if self.parts() == 1 {
            return layout.initial_values(range, seed);
        }
        let mut out = vec![0.0; range.len()];
        for r in self.runs(layout) {
            let lo = r.stored.max(range.start);
            let hi = (r.stored + r.len).min(range.end);
            if lo >= hi {
                continue;
            }
            let from = r.canonical + (lo - r.stored);
            let values = layout.initial_values(from..from + (hi - lo), seed);
            out[lo - range.start..hi - range.start].copy_from_slice(&values);
        }
        out
    }
}

/// `(rows, channels)` of each image layer's output map that each partition
/// computes: `splits[i][p]`.
fn image_splits(layout: &Layout, parts: usize) -> Vec<Vec<(Range<usize>, Range<usize>)>> {
    let mut splits: Vec<Vec<(Range<usize>, Range<usize>)>> = Vec::new();
    for layer in &layout.image {
        let (h, c) = (layer.output.height, layer.output.channels);
        let split = match (&layer.op, splits.last()) {
            (ImageOp::Conv { tied: true, .. }, _) => shard_ranges(c, parts)
                .into_iter()
                .map(|ch| (0..h, ch))
                .collect(),
            // A pool over channel slices pools those slices: nothing crosses.
            (ImageOp::MaxPool | ImageOp::AvgPool, Some(prev))
                if prev
                    .iter()
                    .all(|(rows, _)| rows.len() == layer.input.height) =>
            {
                prev.iter().map(|(_, ch)| (0..h, ch.clone())).collect()
            }
            // A pool over row bands: the output rows whose windows start in
            // the partition's band, so that little beyond it is needed.
            (ImageOp::MaxPool | ImageOp::AvgPool, Some(prev)) => {
                let s = layer.window.stride;
                let starts: Vec<usize> = prev
                    .iter()
                    .enumerate()
                    .map(|(p, (rows, _))| {
                        if p == 0 {
                            0
                        } else {
                            rows.start.div_ceil(s).min(h)
                        }
                    })
                    .collect();
                (0..parts)
                    .map(|p| {
                        let end = starts.get(p + 1).copied().unwrap_or(h).max(starts[p]);
                        (starts[p]..end, 0..c)
                    })
                    .collect()
            }
            _ => shard_ranges(h, parts)
                .into_iter()
                .map(|rows| (rows, 0..c))
                .collect(),
        };
        splits.push(split);
    }
    splits
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Activation, DenseLayer, Loss, ModelSpec, OutputLayer};

    fn layout() -> Layout {
        Layout::from_model(&ModelSpec {
            tables: Vec::new(),
            wide: None,
            cross: None,
            dot_interaction: false,
            input_size: 7,
            input_shape: None,
            layers: Vec::new(),
            hidden: vec![
                DenseLayer {
                    units: 9,
                    activation: Activation::Relu,
                },
                DenseLayer {
                    units: 5,
                    activation: Activation::Tanh,
                },
            ],
            output: OutputLayer {
                units: 4,
                loss: Loss::SoftmaxCrossEntropy,
            },
        })
    }

    #[test]
    fn one_partition_is_the_layout_itself() {
        let l = layout();
        let p = Partitioning::new(&l, 1);
        assert_eq!(p.range(0), 0..l.len());
        for (b, layer) in p.blocks(0).iter().zip(&l.layers) {
            assert_eq!((&b.weight, &b.bias), (&layer.weight, &layer.bias));
        }
        assert_eq!(p.shard_ranges(3), l.shard_ranges(3));
        let v: Vec<f32> = (0..l.len()).map(|i| i as f32).collect();
        assert_eq!(p.to_stored(&l, &v), v);
    }

    #[test]
    fn partitions_cover_every_parameter_once_and_shards_align() {
        let l = layout();
        for parts in [2, 3, 4] {
            let p = Partitioning::new(&l, parts);
            assert_eq!(p.range(parts - 1).end, l.len());
            for layer in 0..l.layers.len() {
                let units: usize = (0..parts).map(|q| p.blocks(q)[layer].units.len()).sum();
                assert_eq!(units, l.layers[layer].units);
            }
            let canonical: Vec<f32> = (0..l.len()).map(|i| i as f32).collect();
            let stored = p.to_stored(&l, &canonical);
            let mut sorted = stored.clone();
            sorted.sort_by(f32::total_cmp);
            assert_eq!(sorted, canonical, "a permutation");
            assert_eq!(p.to_canonical(&l, &stored), canonical);
            let shards = p.shard_ranges(2 * parts);
            for q in 0..parts {
                let own = p.shards_of(q, 2 * parts);
                assert_eq!(shards[own.start].start, p.range(q).start);
                assert_eq!(shards[own.end - 1].end, p.range(q).end);
            }
        }
    }

    fn image_layout() -> Layout {
        use crate::spec::{Conv2dLayer, InputShape, LayerSpec, PoolLayer};
        let conv = |filters| Conv2dLayer {
            filters,
            kernel: 3,
            stride: 1,
            padding: 1,
            activation: Activation::Relu,
        };
        Layout::from_model(&ModelSpec {
            tables: Vec::new(),
            wide: None,
            cross: None,
            dot_interaction: false,
            input_size: 2 * 10 * 6,
            input_shape: Some(InputShape {
                channels: 2,
                height: 10,
                width: 6,
            }),
            layers: vec![
                LayerSpec {
                    locally_connected2d: Some(conv(3)),
                    ..LayerSpec::default()
                },
                LayerSpec {
                    max_pool2d: Some(PoolLayer {
                        size: 2,
                        stride: None,
                    }),
                    ..LayerSpec::default()
                },
                LayerSpec {
                    conv2d: Some(conv(5)),
                    ..LayerSpec::default()
                },
            ],
            hidden: Vec::new(),
            output: OutputLayer {
                units: 4,
                loss: Loss::SoftmaxCrossEntropy,
            },
        })
    }

    #[test]
    fn image_layers_split_by_rows_and_by_filters() {
        let l = image_layout();
        let p = Partitioning::new(&l, 2);
        let (a, b) = (p.image_blocks(0), p.image_blocks(1));
        // locallyConnected2d: rows; the pool after it: the rows its band
        // starts; conv2d: filters.
        assert_eq!((a[0].rows.clone(), b[0].rows.clone()), (0..5, 5..10));
        assert_eq!((a[1].rows.clone(), b[1].rows.clone()), (0..3, 3..5));
        assert_eq!((a[2].channels.clone(), b[2].channels.clone()), (0..3, 3..5));
        assert_eq!(a[0].kernel.len(), 5 * 6 * (3 * 3 * 2) * 3);
        assert_eq!(b[2].kernel.len(), 3 * 3 * 3 * 2);
        assert!(a[1].kernel.is_empty(), "pooling has no parameters");
        let canonical: Vec<f32> = (0..l.len()).map(|i| i as f32).collect();
        let stored = p.to_stored(&l, &canonical);
        let mut sorted = stored.clone();
        sorted.sort_by(f32::total_cmp);
        assert_eq!(sorted, canonical, "a permutation");
        assert_eq!(p.to_canonical(&l, &stored), canonical);
        // The second partition's conv2d kernel row 0 holds filters 3 and 4.
        let conv = &l.tensors[2];
        assert_eq!(
            &stored[b[2].kernel.start..b[2].kernel.start + 2],
            &[(conv.offset + 3) as f32, (conv.offset + 4) as f32]
        );
    }

    #[test]
    fn partitioned_init_is_the_unpartitioned_model() {
        let l = image_layout();
        let whole = l.initial_values(0..l.len(), 3);
        let p = Partitioning::new(&l, 2);
        let mut joined = Vec::new();
        for r in p.shard_ranges(4) {
            joined.extend(p.initial_values(&l, r, 3));
        }
        assert_eq!(p.to_canonical(&l, &joined), whole);
        dense_init_is_the_unpartitioned_model();
    }

    fn dense_init_is_the_unpartitioned_model() {
        let l = layout();
        let whole = l.initial_values(0..l.len(), 3);
        let p = Partitioning::new(&l, 3);
        let mut joined = Vec::new();
        for r in p.shard_ranges(6) {
            joined.extend(p.initial_values(&l, r, 3));
        }
        assert_eq!(p.to_canonical(&l, &joined), whole);
    }
}
