//! A saved model file, as `distbelief eval` reads it.

use std::collections::HashMap;

use distbelief_api::layout::{KeyedTable, Layout, Tables};
use distbelief_api::{DenseLayer, ModelSpec, OutputLayer};
use distbelief_model::saved::{self, SavedTable};

/// The model the target reads files as: 5 inputs, 4 hidden, 3 outputs, a
/// table of dimension 3 and a wide table.
pub(crate) fn model() -> (Layout, Tables) {
    let layout = Layout::from_model(&ModelSpec {
        tables: Vec::new(),
        wide: None,
        cross: None,
        dot_interaction: false,
        input_size: 5,
        input_shape: None,
        layers: Vec::new(),
        hidden: vec![DenseLayer {
            units: 4,
            activation: Default::default(),
        }],
        output: OutputLayer {
            units: 3,
            loss: Default::default(),
        },
    });
    let table = |id: u32, name: &str, dim: usize| KeyedTable {
        id,
        name: name.into(),
        dim,
        fields: vec![0],
        capacity: None,
        min_count: 1,
        row_wise: false,
        init_scale: 0.1,
        pooling: distbelief_api::Pooling::Sum,
    };
    let tables = Tables {
        fields: vec!["f".into()],
        tables: vec![table(0, "user", 3), table(1, "wide", 1)],
        wide: Some(1),
        dot_interaction: false,
    };
    (layout, tables)
}

/// A file the target's model reads back: some rows in each table.
pub(crate) fn seed() -> Vec<u8> {
    let (layout, _) = model();
    // Seeds are made by tests running side by side: a directory each.
    static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("distbelief-seed-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let path = dir.join("model.safetensors");
    let params: Vec<f32> = (0..layout.len()).map(|i| i as f32 / 8.0).collect();
    let tables = [
        SavedTable {
            name: "user".into(),
            dim: 3,
            keys: vec![1, 99],
            values: vec![0.5, -0.5, 1.0, 2.0, 3.0, 4.0],
        },
        SavedTable {
            name: "wide".into(),
            dim: 1,
            keys: vec![7],
            values: vec![0.25],
        },
    ];
    let meta = HashMap::from([("job".to_string(), "seed".to_string())]);
    saved::save(&path, &layout, &params, &tables, meta).expect("the seed model saves");
    let bytes = std::fs::read(&path).expect("the seed model reads");
    let _ = std::fs::remove_dir_all(&dir);
    bytes
}

/// Whatever the bytes, reading them answers a model or an error; a model
/// read has a value for every key of every table.
pub fn saved_model(data: &[u8]) {
    let (layout, tables) = model();
    if let Ok(m) = saved::from_bytes(data, "fuzz", &layout, &tables) {
        assert_eq!(m.params.len(), layout.len());
        for (t, want) in m.tables.iter().zip(&tables.tables) {
            assert_eq!(t.values.len(), t.keys.len() * want.dim);
        }
    }
}
