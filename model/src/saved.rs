//! A trained model on disk: `model.safetensors`, one f32 tensor per entry of
//! the layout under its layout name and shape, and each embedding table's
//! stored keys and rows, so that any safetensors reader (PyTorch, candle,
//! ...) can load it.

use std::collections::HashMap;
use std::path::Path;

use distbelief_api::Layout;
use distbelief_api::layout::Tables;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::wide_deep::TableRows;

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

/// A table's stored rows as the model keeps them: its keys, and `dim`
/// values per key, under `table/<name>/keys` (U64, [rows]) and
/// `table/<name>/rows` (F32, [rows, dim]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SavedTable {
    pub name: String,
    pub dim: usize,
    pub keys: Vec<u64>,
    pub values: Vec<f32>,
}

/// A saved model read back: the flat dense vector and the tables.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    pub params: Vec<f32>,
    pub tables: Vec<SavedTable>,
}

// Tensors are written straight from memory, which is their little-endian
// byte order only on little-endian machines.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "saved models are written on little-endian machines"
);

fn keys_name(table: &str) -> String {
    format!("table/{table}/keys")
}

fn rows_name(table: &str) -> String {
    format!("table/{table}/rows")
}

impl SavedTable {
    /// The rows of `keys` (distinct), for scoring: saved rows as they are,
    /// the others as `init` says they start. One pass over the saved keys,
    /// so a large table needs no map of its own.
    pub fn rows_for(&self, keys: &[u64], init: impl Fn(u64, &mut [f32])) -> TableRows {
        let want: HashMap<u64, usize> = keys.iter().enumerate().map(|(i, &k)| (k, i)).collect();
        let dim = self.dim;
        let mut values = vec![0.0f32; keys.len() * dim];
        let mut found = vec![false; keys.len()];
        for (k, row) in self.keys.iter().zip(self.values.chunks_exact(dim)) {
            if let Some(&i) = want.get(k) {
                values[i * dim..(i + 1) * dim].copy_from_slice(row);
                found[i] = true;
            }
        }
        for (i, &k) in keys.iter().enumerate() {
            if !found[i] {
                init(k, &mut values[i * dim..(i + 1) * dim]);
            }
        }
        TableRows::new(dim, keys.to_vec(), values)
    }
}

/// For each of `tables`, the rows of its `keys` as scoring needs them:
/// from `saved`, or, for a key the file lacks, as the shards would start it
/// from the job's `seed`.
pub fn rows_of(
    tables: &Tables,
    saved: &[SavedTable],
    keys: &[Vec<u64>],
    seed: u64,
) -> Vec<TableRows> {
    tables
        .tables
        .iter()
        .zip(saved)
        .zip(keys)
        .map(|((t, s), keys)| {
            s.rows_for(keys, |k, out| {
                crate::keys::initial_row(seed, t.id, t.init_scale, k, out)
            })
        })
        .collect()
}

/// Writes `params` (the flat vector of `layout`) and `tables` to `path`,
/// through a temporary file so that a reader never sees half a model.
pub fn save(
    path: &Path,
    layout: &Layout,
    params: &[f32],
    tables: &[SavedTable],
    metadata: HashMap<String, String>,
) -> Result<(), SavedModelError> {
    let p = path.display().to_string();
    let format = |e: safetensors::SafeTensorError| SavedModelError::Format {
        path: p.clone(),
        message: e.to_string(),
    };
    if params.len() != layout.len() {
        return Err(SavedModelError::Mismatch {
            path: p.clone(),
            message: format!(
                "{} parameters given, the layout has {}",
                params.len(),
                layout.len()
            ),
        });
    }
    let mut views = Vec::with_capacity(layout.tensors.len() + 2 * tables.len());
    for t in &layout.tensors {
        let bytes: &[u8] = bytemuck::cast_slice(&params[t.range()]);
        let view = TensorView::new(Dtype::F32, t.shape.clone(), bytes).map_err(format)?;
        views.push((t.name.clone(), view));
    }
    for t in tables {
        if t.values.len() != t.keys.len() * t.dim {
            return Err(SavedModelError::Mismatch {
                path: p.clone(),
                message: format!(
                    "table {} has {} values for {} keys of dimension {}",
                    t.name,
                    t.values.len(),
                    t.keys.len(),
                    t.dim
                ),
            });
        }
        let keys = TensorView::new(
            Dtype::U64,
            vec![t.keys.len()],
            bytemuck::cast_slice(&t.keys),
        )
        .map_err(format)?;
        let rows = TensorView::new(
            Dtype::F32,
            vec![t.keys.len(), t.dim],
            bytemuck::cast_slice(&t.values),
        )
        .map_err(format)?;
        views.push((keys_name(&t.name), keys));
        views.push((rows_name(&t.name), rows));
    }
    let tmp = path.with_extension("safetensors.tmp");
    // Written tensor by tensor: a large table is not copied into one buffer first.
    safetensors::serialize_to_file(views, Some(metadata), &tmp).map_err(format)?;
    std::fs::rename(&tmp, path).map_err(|source| SavedModelError::Write {
        path: p.clone(),
        source,
    })
}

/// Reads a model saved by [`save`] back: the flat vector of `layout` and
/// each of `tables`, checking every tensor's name, type and shape.
pub fn load(path: &Path, layout: &Layout, tables: &Tables) -> Result<Loaded, SavedModelError> {
    let p = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| SavedModelError::Read {
        path: p.clone(),
        source,
    })?;
    from_bytes(&bytes, &p, layout, tables)
}

/// [`load`] of a file's bytes; `p` names it in errors.
pub fn from_bytes(
    bytes: &[u8],
    p: &str,
    layout: &Layout,
    tables: &Tables,
) -> Result<Loaded, SavedModelError> {
    let p = p.to_string();
    let file = SafeTensors::deserialize(bytes).map_err(|e| SavedModelError::Format {
        path: p.clone(),
        message: e.to_string(),
    })?;
    let mismatch = |message: String| SavedModelError::Mismatch {
        path: p.clone(),
        message,
    };
    let expected = layout.tensors.len() + 2 * tables.tables.len();
    if file.len() != expected {
        return Err(mismatch(format!(
            "{} tensors, the model has {expected} ({} for the layers, 2 for each of {} tables)",
            file.len(),
            layout.tensors.len(),
            tables.tables.len()
        )));
    }
    let tensor = |name: &str, dtype: Dtype| {
        let view = file
            .tensor(name)
            .map_err(|_| mismatch(format!("no tensor {name}")))?;
        if view.dtype() != dtype {
            return Err(mismatch(format!(
                "{name} is {:?}, the model wants {dtype:?}",
                view.dtype()
            )));
        }
        Ok(view)
    };
    let mut params = vec![0.0f32; layout.len()];
    for t in &layout.tensors {
        let view = tensor(&t.name, Dtype::F32)?;
        if view.shape() != t.shape.as_slice() {
            return Err(mismatch(format!(
                "{} has shape {:?}, the model wants {:?}",
                t.name,
                view.shape(),
                t.shape
            )));
        }
        read_f32(view.data(), &mut params[t.range()]);
    }
    let mut saved = Vec::with_capacity(tables.tables.len());
    for t in &tables.tables {
        let (kn, rn) = (keys_name(&t.name), rows_name(&t.name));
        let keys = tensor(&kn, Dtype::U64)?;
        let rows = tensor(&rn, Dtype::F32)?;
        let n = keys.shape().first().copied().unwrap_or(0);
        if keys.shape().len() != 1 || rows.shape() != [n, t.dim] {
            return Err(mismatch(format!(
                "{kn} has shape {:?} and {rn} {:?}; the model wants [rows] and [rows, {}]",
                keys.shape(),
                rows.shape(),
                t.dim
            )));
        }
        let mut values = vec![0.0f32; n * t.dim];
        read_f32(rows.data(), &mut values);
        saved.push(SavedTable {
            name: t.name.clone(),
            dim: t.dim,
            keys: keys
                .data()
                .chunks_exact(8)
                .map(|c| {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(c);
                    u64::from_le_bytes(b)
                })
                .collect(),
            values,
        });
    }
    Ok(Loaded {
        params,
        tables: saved,
    })
}

fn read_f32(bytes: &[u8], out: &mut [f32]) {
    for (dst, src) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distbelief_api::{DenseLayer, ModelSpec, OutputLayer};

    fn layout(hidden: u32) -> Layout {
        Layout::from_model(&ModelSpec {
            tables: Vec::new(),
            wide: None,
            cross: None,
            dot_interaction: false,
            input_size: 5,
            input_shape: None,
            layers: Vec::new(),
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
        save(&path, &l, &params, &[], meta).unwrap();
        assert_eq!(load(&path, &l, &Tables::default()).unwrap().params, params);

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
        save(&path, &small, &vec![0.5; small.len()], &[], HashMap::new()).unwrap();
        let none = Tables::default();
        let err = load(&path, &layout(6), &none).unwrap_err().to_string();
        assert!(err.contains("dense0/weight"), "{err}");
        std::fs::write(&path, b"not a model").unwrap();
        assert!(matches!(
            load(&path, &small, &none),
            Err(SavedModelError::Format { .. })
        ));
    }

    fn tables(dims: &[(&str, usize)]) -> Tables {
        Tables {
            fields: vec!["f".into()],
            tables: dims
                .iter()
                .enumerate()
                .map(|(id, &(name, dim))| distbelief_api::layout::KeyedTable {
                    id: id as u32,
                    name: name.into(),
                    dim,
                    fields: vec![0],
                    capacity: None,
                    min_count: 1,
                    row_wise: false,
                    init_scale: 0.1,
                    pooling: distbelief_api::Pooling::Sum,
                })
                .collect(),
            wide: None,
            dot_interaction: false,
        }
    }

    #[test]
    fn tables_are_saved_as_keys_and_rows_and_read_back_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(MODEL_FILE);
        let l = layout(2);
        let params = vec![0.25; l.len()];
        let saved = vec![
            SavedTable {
                name: "user".into(),
                dim: 3,
                keys: vec![u64::MAX, 7],
                values: vec![1.0, 2.0, 3.0, -1.0, -2.0, -3.0],
            },
            SavedTable {
                name: "wide".into(),
                dim: 1,
                keys: Vec::new(),
                values: Vec::new(),
            },
        ];
        save(&path, &l, &params, &saved, HashMap::new()).unwrap();
        let t = tables(&[("user", 3), ("wide", 1)]);
        let back = load(&path, &l, &t).unwrap();
        assert_eq!((back.params, back.tables), (params, saved));

        let bytes = std::fs::read(&path).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(file.tensor("table/user/rows").unwrap().shape(), &[2, 3]);
        assert_eq!(file.tensor("table/user/keys").unwrap().dtype(), Dtype::U64);

        // A job whose table has another dimension, or lacks a table, is told which.
        let err = load(&path, &l, &tables(&[("user", 4), ("wide", 1)]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("table/user/rows") && err.contains("4]"),
            "{err}"
        );
        let err = load(&path, &l, &tables(&[("user", 3)]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("2 for each of 1 tables"), "{err}");
    }

    #[test]
    fn rows_for_takes_saved_rows_and_starts_the_others_as_the_shards_would() {
        let table = SavedTable {
            name: "t".into(),
            dim: 2,
            keys: vec![10, 20],
            values: vec![1.0, 1.5, 2.0, 2.5],
        };
        let rows = table.rows_for(&[20, 30], |k, out| out.fill(k as f32));
        assert_eq!(rows.row(20), [2.0, 2.5]);
        assert_eq!(rows.row(30), [30.0, 30.0]);
    }
}
