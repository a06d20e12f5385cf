//! Paging a table's stored rows off the shards, for the saved model.

use std::time::{Duration, Instant};

use distbelief_proto::codec::decode_f32_into;
use distbelief_proto::v1::ExportRequest;

use crate::{ClientError, ShardClient};

/// Rows per page asked for: about a megabyte of 8-dimensional rows.
const PAGE_ROWS: u32 = 32 * 1024;

/// How long one page may keep failing before the export gives up: long
/// enough for a chain to replace a member that died under it.
const PAGE_PATIENCE: Duration = Duration::from_secs(30);

/// A table's stored rows, from every shard: keys, and `dim` values per key.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ExportedRows {
    pub keys: Vec<u64>,
    pub values: Vec<f32>,
}

impl ShardClient {
    /// Every row of `table` this shard stores, appended to `out`, a page
    /// per call. A failed page is asked again (of the member the failure
    /// named) until PAGE_PATIENCE runs out. Pages already read stand while
    /// the same member answers; once another does, the shard's rows are read
    /// again from the first slot, since slots are one member's layout (a
    /// member that caught up holds its rows packed, and a capped table's
    /// freed slots are reused in an order of its own).
    pub async fn export_rows(
        &mut self,
        table: u32,
        dim: usize,
        out: &mut ExportedRows,
    ) -> Result<(), ClientError> {
        let before = (out.keys.len(), out.values.len());
        let mut answering = self.addr().to_string();
        let mut from = Some(0u64);
        let mut backoff = distbelief_net::Backoff::default();
        let mut failing_since: Option<Instant> = None;
        while let Some(slot) = from {
            let req = ExportRequest {
                shard: self.index,
                table,
                from_slot: slot,
                max_rows: PAGE_ROWS,
            };
            let reply =
                match tokio::time::timeout(self.timeout, self.client().export_rows(req)).await {
                    Ok(Ok(r)) => r.into_inner(),
                    failed => {
                        let status = match failed {
                            Ok(Err(s)) => s,
                            _ => tonic::Status::deadline_exceeded(
                                "a page of rows not answered in time",
                            ),
                        };
                        let e = self.rpc(status);
                        let since = *failing_since.get_or_insert_with(Instant::now);
                        if since.elapsed() > PAGE_PATIENCE {
                            return Err(e);
                        }
                        tokio::time::sleep(backoff.next_delay()).await;
                        continue;
                    }
                };
            failing_since = None;
            backoff.reset();
            if self.addr() != answering {
                answering = self.addr().to_string();
                if slot > 0 {
                    out.keys.truncate(before.0);
                    out.values.truncate(before.1);
                    from = Some(0);
                    continue;
                }
            }
            if reply.keys.len() % 8 != 0 || reply.rows.len() != reply.keys.len() / 8 * 4 * dim {
                return Err(self.bad(format!(
                    "{} key bytes with {} row bytes for table {table} of dimension {dim}",
                    reply.keys.len(),
                    reply.rows.len()
                )));
            }
            if reply.next_slot.is_some_and(|n| n <= slot) {
                return Err(self.bad(format!(
                    "export of table {table} went back from slot {slot}"
                )));
            }
            out.keys.extend(reply.keys.chunks_exact(8).map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                u64::from_le_bytes(b)
            }));
            let at = out.values.len();
            out.values.resize(at + reply.rows.len() / 4, 0.0);
            if decode_f32_into(&reply.rows, &mut out.values[at..]).is_none() {
                return Err(self.bad(format!("{} bytes of rows", reply.rows.len())));
            }
            from = reply.next_slot;
        }
        Ok(())
    }
}

/// Every stored row of `table` over all shards, one after the other. In a
/// `capped` table a key can come twice, when it was evicted and stored
/// again during the export: the later copy is the one kept. (Without a
/// capacity no slot is ever freed, so no key comes twice, and the map
/// that finds them is not built.)
pub async fn export_table(
    clients: &mut [ShardClient],
    table: u32,
    dim: usize,
    capped: bool,
) -> Result<ExportedRows, ClientError> {
    let mut out = ExportedRows::default();
    for c in clients.iter_mut() {
        c.export_rows(table, dim, &mut out).await?;
    }
    Ok(if capped {
        dedup_keep_last(out, dim)
    } else {
        out
    })
}

fn dedup_keep_last(rows: ExportedRows, dim: usize) -> ExportedRows {
    let mut last = std::collections::HashMap::with_capacity(rows.keys.len());
    for (i, &k) in rows.keys.iter().enumerate() {
        last.insert(k, i);
    }
    if last.len() == rows.keys.len() {
        return rows;
    }
    let mut out = ExportedRows::default();
    for (i, &k) in rows.keys.iter().enumerate() {
        if last.get(&k) == Some(&i) {
            out.keys.push(k);
            out.values
                .extend_from_slice(&rows.values[i * dim..(i + 1) * dim]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_exported_twice_keeps_its_later_row() {
        let rows = ExportedRows {
            keys: vec![5, 7, 5],
            values: vec![1.0, 1.0, 2.0, 2.0, 3.0, 3.0],
        };
        let d = dedup_keep_last(rows, 2);
        assert_eq!(d.keys, [7, 5]);
        assert_eq!(d.values, [2.0, 2.0, 3.0, 3.0]);
    }
}
