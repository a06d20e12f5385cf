//! The image layers of a model (conv2d, locallyConnected2d, pooling): their
//! shapes, layer by layer, and where their tensors sit in the flat vector.
//! They run before the dense layers, on channels-last feature maps.

use std::ops::Range;

use crate::spec::{Activation, Conv2dLayer, DenseLayer, LayerSpec, ModelSpec, PoolLayer};

/// The largest kernel or pooling window side.
pub const MAX_WINDOW: u32 = 1024;
/// The most filters a conv2d or locallyConnected2d layer may have.
pub const MAX_FILTERS: u32 = 65536;

/// One example's feature map, channels last: value (y, x, c) is at
/// `(y × width + x) × channels + c`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapShape {
    pub height: usize,
    pub width: usize,
    pub channels: usize,
}

impl MapShape {
    pub fn len(&self) -> usize {
        self.height * self.width * self.channels
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn pixels(&self) -> usize {
        self.height * self.width
    }
}

/// A square window swept over the input: a kernel or a pooling window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub size: usize,
    pub stride: usize,
    pub padding: usize,
}

impl Window {
    /// Output positions along an input side of `n`; `None` when the window
    /// does not fit.
    fn positions(&self, n: usize) -> Option<usize> {
        let padded = n + 2 * self.padding;
        (padded >= self.size && self.stride >= 1).then(|| (padded - self.size) / self.stride + 1)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageOp {
    /// A convolution with `kernel` of shape `[size, size, in channels,
    /// filters]` when `tied` (conv2d), or one such kernel per output
    /// position, `[out height, out width, size, size, in channels,
    /// filters]`, when not (locallyConnected2d). The bias is per filter, or
    /// per output value when untied.
    Conv {
        tied: bool,
        kernel: Range<usize>,
        bias: Range<usize>,
    },
    MaxPool,
    AvgPool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageLayer {
    /// The layer's name in the spec and in tensor names: `conv2d0`,
    /// `locallyConnected2d0`, `maxPool2d0`, … (numbered per kind).
    pub name: String,
    pub input: MapShape,
    pub output: MapShape,
    pub window: Window,
    pub op: ImageOp,
    pub activation: Activation,
}

impl ImageLayer {
    /// Values in one window of the input: kernel rows of im2col.
    pub fn patch(&self) -> usize {
        self.window.size * self.window.size * self.input.channels
    }

    /// Multiply-adds of one example's forward pass.
    pub fn macs(&self) -> usize {
        match self.op {
            ImageOp::Conv { .. } => self.output.len() * self.patch(),
            _ => self.output.len() * self.window.size * self.window.size,
        }
    }
}

/// The layer list, resolved: image layers with their shapes, then dense
/// layers on the flattened result.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub image: Vec<ImageLayer>,
    /// Tensors of the image layers, in order, from offset 0.
    pub tensors: Vec<super::Tensor>,
    /// Features the dense layers start from.
    pub flat_inputs: usize,
    pub dense: Vec<DenseLayer>,
}

/// A layer that cannot follow what comes before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerError {
    /// `spec.model.layers[i]`, or `spec.model.inputShape`.
    pub field: String,
    pub message: String,
}

/// The model's layers as dense layers, whichever way the spec says them.
fn listed(model: &ModelSpec) -> Vec<LayerSpec> {
    if model.layers.is_empty() {
        model
            .hidden
            .iter()
            .map(|d| LayerSpec {
                dense: Some(d.clone()),
                ..LayerSpec::default()
            })
            .collect()
    } else {
        model.layers.clone()
    }
}

/// Walks the layer list, checking each layer's shape against its input.
pub fn resolve(model: &ModelSpec, flat_inputs: usize) -> Result<Resolved, LayerError> {
    let mut map = model.input_shape.map(|s| MapShape {
        height: s.height as usize,
        width: s.width as usize,
        channels: s.channels as usize,
    });
    if let Some(m) = map
        && (m.is_empty() || m.len() != model.input_size as usize)
    {
        return Err(LayerError {
            field: "spec.model.inputShape".into(),
            message: format!(
                "channels × height × width is {} but inputSize is {}; they must be equal and at least 1",
                m.len(),
                model.input_size
            ),
        });
    }
    let mut out = Resolved {
        image: Vec::new(),
        tensors: Vec::new(),
        flat_inputs,
        dense: Vec::new(),
    };
    let mut counts = [0usize; 4];
    let mut offset = 0;
    let mut flat_since: Option<usize> = None;
    for (i, layer) in listed(model).iter().enumerate() {
        let field = format!("spec.model.layers[{i}]");
        let fail = |message: String| LayerError {
            field: field.clone(),
            message,
        };
        if layer.kinds() != 1 {
            return Err(fail(crate::admission::MSG_ONE_LAYER_KIND.into()));
        }
        if let Some(d) = &layer.dense {
            // A zero in `hidden` has a rule (and a message) of its own.
            if d.units == 0 && !model.layers.is_empty() {
                return Err(fail("dense: units must be at least 1".into()));
            }
            flat_since.get_or_insert(i);
            out.dense.push(d.clone());
            continue;
        }
        if layer.flatten.is_some() {
            flat_since.get_or_insert(i);
            continue;
        }
        let (kind, k) = match layer {
            LayerSpec {
                conv2d: Some(_), ..
            } => ("conv2d", 0),
            LayerSpec {
                locally_connected2d: Some(_),
                ..
            } => ("locallyConnected2d", 1),
            LayerSpec {
                max_pool2d: Some(_),
                ..
            } => ("maxPool2d", 2),
            _ => ("avgPool2d", 3),
        };
        if let Some(j) = flat_since {
            return Err(fail(format!(
                "{kind} needs an image, but layers[{j}] already made the input flat: image layers come before flatten and dense layers"
            )));
        }
        let Some(input) = map else {
            return Err(fail(format!(
                "{kind} needs an image input: set spec.model.inputShape"
            )));
        };
        let name = format!("{kind}{}", counts[k]);
        counts[k] += 1;
        let (window, filters, activation) = match (&layer.conv2d, &layer.locally_connected2d) {
            (Some(c), _) | (_, Some(c)) => conv_window(c, kind).map_err(&fail)?,
            _ => {
                let p: &PoolLayer = layer
                    .max_pool2d
                    .as_ref()
                    .or(layer.avg_pool2d.as_ref())
                    .expect("one kind is set");
                if p.size == 0 || p.stride == Some(0) || p.size > MAX_WINDOW {
                    return Err(fail(format!(
                        "{kind}: size and stride must be at least 1, and size at most {MAX_WINDOW}"
                    )));
                }
                let w = Window {
                    size: p.size as usize,
                    stride: p.stride.unwrap_or(p.size) as usize,
                    padding: 0,
                };
                (w, input.channels, Activation::Linear)
            }
        };
        let (Some(height), Some(width)) = (
            window.positions(input.height),
            window.positions(input.width),
        ) else {
            return Err(fail(format!(
                "{kind}: a {s}×{s} window (padding {p}) does not fit a {h}×{w} input",
                s = window.size,
                p = window.padding,
                h = input.height,
                w = input.width
            )));
        };
        let output = MapShape {
            height,
            width,
            channels: filters,
        };
        let op = match k {
            0 | 1 => {
                let tied = k == 0;
                let (kernel_shape, bias_shape) = if tied {
                    (
                        vec![window.size, window.size, input.channels, filters],
                        vec![filters],
                    )
                } else {
                    (
                        vec![
                            height,
                            width,
                            window.size,
                            window.size,
                            input.channels,
                            filters,
                        ],
                        vec![height, width, filters],
                    )
                };
                // In u128: an absurd spec must not wrap around to a small size.
                let count = |shape: &[usize]| shape.iter().map(|&d| d as u128).product::<u128>();
                let total = offset as u128 + count(&kernel_shape) + count(&bias_shape);
                if total > crate::validate::MAX_PARAMETERS as u128 {
                    return Err(fail(format!(
                        "{kind}: brings the model to {total} parameters; at most {} are supported",
                        crate::validate::MAX_PARAMETERS
                    )));
                }
                let kernel = super::Tensor {
                    name: format!("{name}/kernel"),
                    shape: kernel_shape,
                    offset,
                };
                offset += kernel.len();
                let bias = super::Tensor {
                    name: format!("{name}/bias"),
                    shape: bias_shape,
                    offset,
                };
                offset += bias.len();
                let op = ImageOp::Conv {
                    tied,
                    kernel: kernel.range(),
                    bias: bias.range(),
                };
                out.tensors.push(kernel);
                out.tensors.push(bias);
                op
            }
            2 => ImageOp::MaxPool,
            _ => ImageOp::AvgPool,
        };
        out.image.push(ImageLayer {
            name,
            input,
            output,
            window,
            op,
            activation,
        });
        map = Some(output);
    }
    if let Some(last) = out.image.last() {
        if !model.tables.is_empty() || model.wide.is_some() {
            return Err(LayerError {
                field: "spec.model.layers".into(),
                message: "image layers cannot be combined with tables or a wide part".into(),
            });
        }
        out.flat_inputs = last.output.len();
    }
    Ok(out)
}

fn conv_window(c: &Conv2dLayer, kind: &str) -> Result<(Window, usize, Activation), String> {
    if c.filters == 0 || c.kernel == 0 || c.stride == 0 {
        return Err(format!(
            "{kind}: filters, kernel and stride must be at least 1"
        ));
    }
    if c.kernel > MAX_WINDOW || c.filters > MAX_FILTERS {
        return Err(format!(
            "{kind}: kernel must be at most {MAX_WINDOW} and filters at most {MAX_FILTERS}"
        ));
    }
    if c.padding >= c.kernel {
        return Err(format!(
            "{kind}: padding {} must be less than the kernel ({}), or some windows see only zeros",
            c.padding, c.kernel
        ));
    }
    Ok((
        Window {
            size: c.kernel as usize,
            stride: c.stride as usize,
            padding: c.padding as usize,
        },
        c.filters as usize,
        c.activation,
    ))
}
