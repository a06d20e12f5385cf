//! The synthetic CTR set as Parquet: `label` (INT32), `I1`..`I13` (INT64)
//! and `C1`..`C26` (UTF-8 strings, the ids in hexadecimal as in the TSV
//! files), so that a row keys the same in either format. Row groups of a
//! fixed size, each a streamed job's data shard.

use std::fs::File;
use std::sync::Arc;

use distbelief_model::synth::{self, CATEGORICAL, NUMERIC, Row};
use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int32Type, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

pub struct ParquetSink {
    writer: SerializedFileWriter<File>,
    group_rows: usize,
    pending: Vec<Row>,
}

impl ParquetSink {
    pub fn new(file: File, group_rows: usize) -> anyhow::Result<Self> {
        let mut schema = String::from("message ctr { REQUIRED INT32 label;");
        let names: Vec<String> = synth::header().split('\t').map(str::to_string).collect();
        for name in &names[1..=NUMERIC] {
            schema.push_str(&format!(" REQUIRED INT64 {name};"));
        }
        for name in &names[1 + NUMERIC..] {
            schema.push_str(&format!(" REQUIRED BYTE_ARRAY {name} (UTF8);"));
        }
        schema.push_str(" }");
        let props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .build();
        let writer = SerializedFileWriter::new(
            file,
            Arc::new(parse_message_type(&schema)?),
            Arc::new(props),
        )?;
        Ok(ParquetSink {
            writer,
            group_rows: group_rows.max(1),
            pending: Vec::new(),
        })
    }

    pub fn add(&mut self, block: &[Row]) -> anyhow::Result<()> {
        self.pending.extend_from_slice(block);
        while self.pending.len() >= self.group_rows {
            let rest = self.pending.split_off(self.group_rows);
            let group = std::mem::replace(&mut self.pending, rest);
            self.write_group(&group)?;
        }
        Ok(())
    }

    /// Writes what is left and the footer; the file's size in bytes.
    pub fn finish(mut self) -> anyhow::Result<u64> {
        let rest = std::mem::take(&mut self.pending);
        if !rest.is_empty() {
            self.write_group(&rest)?;
        }
        self.writer.flush()?;
        let file = self.writer.into_inner()?;
        Ok(file.metadata()?.len())
    }

    fn write_group(&mut self, rows: &[Row]) -> anyhow::Result<()> {
        let mut group = self.writer.next_row_group()?;
        let mut column = 0;
        while let Some(mut c) = group.next_column()? {
            match column {
                0 => {
                    let v: Vec<i32> = rows.iter().map(|r| r.label as i32).collect();
                    c.typed::<Int32Type>().write_batch(&v, None, None)?;
                }
                j if j <= NUMERIC => {
                    let v: Vec<i64> = rows.iter().map(|r| i64::from(r.numeric[j - 1])).collect();
                    c.typed::<Int64Type>().write_batch(&v, None, None)?;
                }
                j => {
                    let f = j - 1 - NUMERIC;
                    debug_assert!(f < CATEGORICAL);
                    let v: Vec<ByteArray> = rows
                        .iter()
                        .map(|r| ByteArray::from(format!("{:x}", r.ids[f]).into_bytes()))
                        .collect();
                    c.typed::<ByteArrayType>().write_batch(&v, None, None)?;
                }
            }
            c.close()?;
            column += 1;
        }
        group.close()?;
        Ok(())
    }
}
