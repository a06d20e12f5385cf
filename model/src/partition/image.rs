//! The image layers of a partitioned model. Each partition computes a
//! rectangle of every image layer's output map (a conv2d's filters, a
//! locallyConnected2d's rows; see `distbelief_api::Partitioning`). To do so
//! it needs a window of the input map: every row and channel for a channel
//! split, or its rows plus the receptive fields' halo for a spatial split.
//! Before each layer, every partition sends each peer the part of its own
//! rectangle that falls in the peer's window, and nothing else; backward,
//! the input deltas of its window go back to the rectangles' owners.

use std::ops::Range;

use distbelief_api::Partitioning;
use distbelief_api::layout::image::Window;
use distbelief_api::layout::{ImageBlock, ImageLayer, ImageOp, Layout, MapShape};
use ndarray::{ArrayView2, ArrayViewMut2};

/// A rectangle of a feature map as one example's buffer lays it out: the
/// map's `rows` (some may lie beyond its edge: padding, zeros), each of its
/// `width` columns with `pad` zero columns on either side, and `channels`,
/// channels last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Frame {
    pub rows: Range<isize>,
    pub channels: Range<usize>,
    pub width: usize,
    pub pad: usize,
}

impl Frame {
    pub fn whole(m: MapShape) -> Frame {
        Frame {
            rows: 0..m.height as isize,
            channels: 0..m.channels,
            width: m.width,
            pad: 0,
        }
    }

    fn height(&self) -> usize {
        (self.rows.end - self.rows.start).max(0) as usize
    }

    /// Values per example.
    pub fn len(&self) -> usize {
        self.height() * (self.width + 2 * self.pad) * self.channels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The map values both frames hold, packed (no padding).
    pub fn meet(&self, other: &Frame) -> Frame {
        let rows = self.rows.start.max(other.rows.start)..self.rows.end.min(other.rows.end);
        let channels = self.channels.start.max(other.channels.start)
            ..self.channels.end.min(other.channels.end);
        Frame {
            rows: rows.start..rows.end.max(rows.start),
            channels: channels.start..channels.end.max(channels.start),
            width: self.width,
            pad: 0,
        }
    }

    fn at(&self, y: isize, x: usize, c: usize) -> usize {
        ((y - self.rows.start) as usize * (self.width + 2 * self.pad) + x + self.pad)
            * self.channels.len()
            + c
            - self.channels.start
    }
}

/// Copies rectangle `r` of every example from `src`, laid out as `a`, into
/// `dst`, laid out as `b`; adds instead when `add`.
pub(crate) fn copy(
    r: &Frame,
    a: &Frame,
    src: ArrayView2<f32>,
    b: &Frame,
    mut dst: ArrayViewMut2<f32>,
    add: bool,
) {
    if r.is_empty() {
        return;
    }
    let n = r.channels.len();
    // A map row is one run when neither side pads or holds other channels.
    let (run, per_row) =
        if a.pad == 0 && b.pad == 0 && a.channels == r.channels && b.channels == r.channels {
            (r.width * n, 1)
        } else {
            (n, r.width)
        };
    for (s, mut d) in src.outer_iter().zip(dst.outer_iter_mut()) {
        let s = s.to_slice().expect("rows are contiguous");
        let d = d.as_slice_mut().expect("rows are contiguous");
        for y in r.rows.clone() {
            for x in 0..per_row {
                let i = a.at(y, x, r.channels.start);
                let j = b.at(y, x, r.channels.start);
                let (d, s) = (&mut d[j..j + run], &s[i..i + run]);
                if add {
                    d.iter_mut().zip(s).for_each(|(d, s)| *d += s);
                } else {
                    d.copy_from_slice(s);
                }
            }
        }
    }
}

/// Image layer i as one partition runs it.
#[derive(Debug, Clone)]
pub(crate) struct Part {
    /// The layer over the partition's input window (padding included, so
    /// none left), with its kernel and bias at offsets in the partition's
    /// own parameter range.
    pub layer: ImageLayer,
    /// The input window, on the input map.
    pub band: Frame,
    /// The output rectangle the partition computes.
    pub own: Frame,
}

impl Part {
    fn new(layer: &ImageLayer, b: &ImageBlock, base: usize) -> Part {
        let Window {
            size: k,
            stride: s,
            padding: pad,
        } = layer.window;
        let channels = match layer.op {
            ImageOp::MaxPool | ImageOp::AvgPool => b.channels.clone(),
            ImageOp::Conv { .. } => 0..layer.input.channels,
        };
        let rows = if b.rows.is_empty() || b.channels.is_empty() {
            0..0
        } else {
            (b.rows.start * s) as isize - pad as isize
                ..((b.rows.end - 1) * s + k) as isize - pad as isize
        };
        let band = Frame {
            rows,
            channels,
            width: layer.input.width,
            pad,
        };
        let own = Frame {
            rows: b.rows.start as isize..b.rows.end as isize,
            channels: b.channels.clone(),
            width: layer.output.width,
            pad: 0,
        };
        let op = match &layer.op {
            ImageOp::Conv { tied, .. } => ImageOp::Conv {
                tied: *tied,
                kernel: b.kernel.start - base..b.kernel.end - base,
                bias: b.bias.start - base..b.bias.end - base,
            },
            other => other.clone(),
        };
        let layer = ImageLayer {
            name: layer.name.clone(),
            input: MapShape {
                height: band.height(),
                width: layer.input.width + 2 * pad,
                channels: band.channels.len(),
            },
            output: MapShape {
                height: b.rows.len(),
                width: layer.output.width,
                channels: b.channels.len(),
            },
            window: Window {
                size: k,
                stride: s,
                padding: 0,
            },
            op,
            activation: layer.activation,
        };
        Part { layer, band, own }
    }

    /// The input values this partition reads, packed.
    pub fn needs(&self, input: MapShape) -> Frame {
        self.band.meet(&Frame::whole(input))
    }
}

/// `parts[q][i]`: how partition q runs image layer i.
pub(crate) fn parts(layout: &Layout, partitioning: &Partitioning) -> Vec<Vec<Part>> {
    (0..partitioning.parts())
        .map(|q| {
            let base = partitioning.range(q).start;
            layout
                .image
                .iter()
                .zip(partitioning.image_blocks(q))
                .map(|(l, b)| Part::new(l, b, base))
                .collect()
        })
        .collect()
}

/// Values per example crossing at each image layer's output, one way (the
/// deltas coming back are as many): what each partition owns of it that a
/// peer's next window needs. The last map goes whole to every peer, for the
/// dense layers.
pub(crate) fn crossings(layout: &Layout, parts: &[Vec<Part>]) -> Vec<(String, usize)> {
    let n = parts.len();
    layout
        .image
        .iter()
        .enumerate()
        .map(|(i, layer)| {
            let values = match layout.image.get(i + 1) {
                Some(next) => (0..n)
                    .flat_map(|p| (0..n).filter(move |&q| q != p).map(move |q| (p, q)))
                    .map(|(p, q)| {
                        parts[p][i]
                            .own
                            .meet(&parts[q][i + 1].needs(next.input))
                            .len()
                    })
                    .sum(),
                None => layer.output.len() * n.saturating_sub(1),
            };
            (layer.name.clone(), values)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_meet_and_index_with_padding() {
        let band = Frame {
            rows: -1..3,
            channels: 0..2,
            width: 4,
            pad: 1,
        };
        let whole = Frame {
            rows: 0..5,
            channels: 0..2,
            width: 4,
            pad: 0,
        };
        let m = band.meet(&whole);
        assert_eq!((m.rows.clone(), m.len()), (0..3, 3 * 4 * 2));
        // Row 0 is the band's second row; column 0 its second.
        assert_eq!(band.at(0, 0, 1), (6 + 1) * 2 + 1);
        let apart = Frame {
            rows: 7..9,
            ..whole.clone()
        };
        assert!(band.meet(&apart).is_empty());
    }
}
