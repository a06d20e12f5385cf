//! A trained model on disk: `model.safetensors`, one f32 tensor per entry of
//! the layout under its layout name and shape, so that any safetensors
//! reader (PyTorch, candle, ...) can load it.

use std::collections::HashMap;
use std::path::Path;

use distbelief_api::Layout;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

pub const MODEL_FILE: &str = "model.safetensors";

#[derive(Debug, thiserror::Error)]
pub enum SavedModelError {
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a safetensors file: {message}")]
    Format { path: String, message: String },
    #[error("{path} does not match the job's model: {message}")]
    Mismatch { path: String, message: String },
}

/// Writes `params` (the flat vector of `layout`) to `path`, through a
/// temporary file so that a reader never sees half a model.
pub fn save(
    path: &Path,
    layout: &Layout,
    params: &[f32],
    metadata: HashMap<String, String>,
) -> Result<(), SavedModelError> {
    let write_err = |source| SavedModelError::Write {
        path: path.display().to_string(),
        source,
    };
    if params.len() != layout.len() {
        return Err(SavedModelError::Mismatch {
            path: path.display().to_string(),
            message: format!(
                "{} parameters given, the layout has {}",
                params.len(),
                layout.len()
            ),
        });
    }
    let bytes: Vec<u8> = params.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut views = Vec::with_capacity(layout.tensors.len());
    for t in &layout.tensors {
        let r = t.range();
        let view = TensorView::new(Dtype::F32, t.shape.clone(), &bytes[r.start * 4..r.end * 4])
            .map_err(|e| SavedModelError::Format {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
        views.push((t.name.clone(), view));
    }
    let data = safetensors::tensor::serialize(views, Some(metadata)).map_err(|e| {
        SavedModelError::Format {
            path: path.display().to_string(),
            message: e.to_string(),
        }
    })?;
    let tmp = path.with_extension("safetensors.tmp");
    std::fs::write(&tmp, data).map_err(write_err)?;
    std::fs::rename(&tmp, path).map_err(write_err)
}

/// Reads a model saved by [`save`] back into the flat vector of `layout`,
/// checking every tensor's name, type and shape.
pub fn load(path: &Path, layout: &Layout) -> Result<Vec<f32>, SavedModelError> {
    let p = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| SavedModelError::Read {
        path: p.clone(),
        source,
    })?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| SavedModelError::Format {
        path: p.clone(),
        message: e.to_string(),
    })?;
    let mismatch = |message: String| SavedModelError::Mismatch {
        path: p.clone(),
        message,
    };
    if file.len() != layout.tensors.len() {
        return Err(mismatch(format!(
            "{} tensors, the model has {}",
            file.len(),
            layout.tensors.len()
        )));
    }
    let mut params = vec![0.0f32; layout.len()];
    for t in &layout.tensors {
        let view = file
            .tensor(&t.name)
            .map_err(|_| mismatch(format!("no tensor {}", t.name)))?;
        if view.dtype() != Dtype::F32 || view.shape() != t.shape.as_slice() {
            return Err(mismatch(format!(
                "{} is {:?} {:?}, the model wants F32 {:?}",
                t.name,
                view.dtype(),
                view.shape(),
                t.shape
            )));
        }
        for (dst, src) in params[t.range()]
            .iter_mut()
            .zip(view.data().chunks_exact(4))
        {
            *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
        }
    }
    Ok(params)
}

#[cfg(test)]
mod tests {
    use super::*;
    use distbelief_api::{DenseLayer, ModelSpec, OutputLayer};

    fn layout(hidden: u32) -> Layout {
        Layout::from_model(&ModelSpec {
            tables: Vec::new(),
            wide: None,
            input_size: 5,
            hidden: vec![DenseLayer {
                units: hidden,
                activation: Default::default(),
            }],
            output: OutputLayer {
                units: 3,
                loss: Default::default(),
            },
        })
    }

    #[test]
    fn saved_parameters_read_back_exactly_under_layout_names() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(MODEL_FILE);
        let l = layout(4);
        let params: Vec<f32> = (0..l.len()).map(|i| i as f32 * 0.25 - 3.0).collect();
        let meta = HashMap::from([("job".to_string(), "t".to_string())]);
        save(&path, &l, &params, meta).unwrap();
        assert_eq!(load(&path, &l).unwrap(), params);

        let bytes = std::fs::read(&path).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let w = file.tensor("dense0/weight").unwrap();
        assert_eq!(w.shape(), &[5, 4]);
        assert_eq!(file.tensor("dense1/bias").unwrap().shape(), &[3]);
    }

    #[test]
    fn a_model_of_another_shape_is_refused_with_the_tensor_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(MODEL_FILE);
        let small = layout(4);
        save(&path, &small, &vec![0.5; small.len()], HashMap::new()).unwrap();
        let err = load(&path, &layout(6)).unwrap_err().to_string();
        assert!(err.contains("dense0/weight"), "{err}");
        std::fs::write(&path, b"not a model").unwrap();
        assert!(matches!(
            load(&path, &small),
            Err(SavedModelError::Format { .. })
        ));
    }
}
