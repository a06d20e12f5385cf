//! Models and inputs the unit tests of several modules build.

use distbelief_api::layout::Layout;
use distbelief_api::{InputShape, LayerSpec, Loss, ModelSpec, OutputLayer};

pub(crate) fn layer(f: impl FnOnce(&mut LayerSpec)) -> LayerSpec {
    let mut l = LayerSpec::default();
    f(&mut l);
    l
}

/// A classifier of `channels × height × width` images through `layers`.
pub(crate) fn image_model(
    (c, h, w): (u32, u32, u32),
    layers: Vec<LayerSpec>,
    classes: u32,
) -> Layout {
    Layout::from_model(&ModelSpec {
        input_size: c * h * w,
        input_shape: Some(InputShape {
            channels: c,
            height: h,
            width: w,
        }),
        layers,
        hidden: Vec::new(),
        output: OutputLayer {
            units: classes,
            loss: Loss::SoftmaxCrossEntropy,
        },
        tables: Vec::new(),
        wide: None,
        cross: None,
        dot_interaction: false,
    })
}

/// `n × d` values in [-1, 1) without the repeats of a short cycle, which
/// would make ties for max pooling, where the loss has a kink.
pub(crate) fn inputs(n: usize, d: usize) -> Vec<f32> {
    (0..n * d)
        .map(|i| ((i as u64 * 2_654_435_761 % 10_007) as f32 / 5_003.5) - 1.0)
        .collect()
}
