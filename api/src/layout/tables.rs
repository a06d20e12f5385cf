//! The keyed side of a model: its embedding tables and wide part as every
//! role sees them, numbered in one order (the model's tables, then the wide
//! part), and which categorical field looks up which table.

use crate::spec::{DataFormat, DataSpec, ModelSpec, Pooling};

/// The one categorical field a libsvm file has: its feature indices.
pub const LIBSVM_FIELD: &str = "features";

/// Rows of values per key, of one table.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyedTable {
    /// Its number on the shards, and in every row's initial values.
    pub id: u32,
    pub name: String,
    pub dim: usize,
    /// Indices into [`Tables::fields`].
    pub fields: Vec<usize>,
    /// Rows kept at most over all shards.
    pub capacity: Option<u64>,
    pub min_count: u32,
    pub row_wise: bool,
    pub init_scale: f32,
    /// How a field with several keys pools their rows.
    pub pooling: Pooling,
}

impl KeyedTable {
    /// Rows one of `shards` shards keeps at most: an even share.
    pub fn shard_capacity(&self, shards: usize) -> Option<usize> {
        self.capacity
            .map(|c| c.div_ceil(shards.max(1) as u64).max(1) as usize)
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Tables {
    /// The data's categorical fields, in the data's order; a field's index
    /// here is its number in every key.
    pub fields: Vec<String>,
    pub tables: Vec<KeyedTable>,
    /// The wide part's table id, if the model has one.
    pub wide: Option<u32>,
    /// The pairwise dot products of the embedding rows follow them in the
    /// first layer's input (`model.dotInteraction`).
    pub dot_interaction: bool,
}

/// The name the wide part's table goes by.
pub const WIDE_TABLE: &str = "wide";

impl Tables {
    /// The model's tables over the data's fields. Fields a table names that
    /// the data lacks are left out here; validation reports them.
    pub fn from_spec(model: &ModelSpec, data: &DataSpec) -> Tables {
        let fields = categorical_fields(data);
        let mut tables: Vec<KeyedTable> = model
            .tables
            .iter()
            .enumerate()
            .map(|(id, t)| KeyedTable {
                id: id as u32,
                name: t.name.clone(),
                dim: t.dim as usize,
                fields: t
                    .fields
                    .iter()
                    .filter_map(|f| fields.iter().position(|g| g == f))
                    .collect(),
                capacity: t.capacity,
                min_count: t.min_count.max(1),
                row_wise: t.row_wise,
                init_scale: t.init_scale as f32,
                pooling: t.pooling,
            })
            .collect();
        let wide = model.wide.as_ref().map(|w| {
            let id = tables.len() as u32;
            tables.push(KeyedTable {
                id,
                name: WIDE_TABLE.to_string(),
                dim: 1,
                fields: (0..fields.len()).collect(),
                capacity: w.capacity,
                min_count: w.min_count.max(1),
                row_wise: false,
                // The wide part starts at zero, as a linear model does.
                init_scale: 0.0,
                // A linear model sums its weights.
                pooling: Pooling::Sum,
            });
            id
        });
        Tables {
            fields,
            tables,
            wide,
            dot_interaction: model.dot_interaction,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    /// The deep tables: every one but the wide part's.
    pub fn deep(&self) -> impl Iterator<Item = &KeyedTable> {
        self.tables.iter().filter(|t| Some(t.id) != self.wide)
    }

    /// Values the embeddings add to each example's input: a row per field
    /// of every deep table.
    pub fn embedding_width(&self) -> usize {
        self.deep().map(|t| t.dim * t.fields.len()).sum()
    }

    /// Embedding rows per example: one per field of every deep table.
    pub fn embedding_rows(&self) -> usize {
        self.deep().map(|t| t.fields.len()).sum()
    }

    /// Values the tables add to each example's input: the rows, then their
    /// pairwise dot products with `dotInteraction`.
    pub fn input_width(&self) -> usize {
        let f = self.embedding_rows();
        self.embedding_width()
            + if self.dot_interaction {
                f * f.saturating_sub(1) / 2
            } else {
                0
            }
    }
}

/// The data's categorical fields.
pub fn categorical_fields(data: &DataSpec) -> Vec<String> {
    match data.format {
        DataFormat::Libsvm => vec![LIBSVM_FIELD.to_string()],
        _ => data.categorical.clone(),
    }
}

/// What a model's tables add to the first dense layer's inputs, from the
/// model alone.
pub fn embedding_width(model: &ModelSpec) -> u128 {
    let rows: u128 = model.tables.iter().map(|t| t.fields.len() as u128).sum();
    let pairs = if model.dot_interaction {
        rows * rows.saturating_sub(1) / 2
    } else {
        0
    };
    model
        .tables
        .iter()
        .map(|t| u128::from(t.dim) * t.fields.len() as u128)
        .sum::<u128>()
        + pairs
}
