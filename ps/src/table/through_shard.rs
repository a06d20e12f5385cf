//! Tables inside a shard: rows travel in the same push as the dense range,
//! through the same push table, checks and checkpoints.

use super::*;
use crate::checkpoint;
use crate::shard::{PushAssembly, PushHeader, PushId, PushOutcome, Rows, Shard, SyncRound};

const ADAGRAD: Optimizer = Optimizer::Adagrad {
    learning_rate: 0.1,
    initial_accumulator: 0.1,
    epsilon: 1e-8,
};

fn configs() -> Vec<TableConfig> {
    (0..2)
        .map(|id| TableConfig {
            id,
            dim: 2 + id as usize,
            seed: 5,
            init_scale: 0.1,
            optimizer: ADAGRAD,
            row_wise: id == 1,
            capacity: Some(6),
            min_count: 1,
        })
        .collect()
}

fn shard() -> Shard {
    Shard::new(0, 0..3, ADAGRAD, vec![0.5; 3]).with_tables(&configs())
}

fn header(incarnation: u64, sequence: u64) -> PushHeader {
    PushHeader {
        shard: 0,
        id: PushId::gradient(1, incarnation, sequence),
    }
}

fn rows(table: u32, keys: &[u64], value: f32) -> Rows {
    let dim = 2 + table as usize;
    Rows {
        table,
        keys: keys.to_vec(),
        values: vec![value; keys.len() * dim],
        squares: Vec::new(),
    }
}

fn row(s: &Shard, table: u32, key: u64) -> Vec<f32> {
    let mut out = vec![0.0; 2 + table as usize];
    s.fetch_rows(table, &[key], &mut out).unwrap();
    out
}

#[test]
fn a_push_moves_its_dense_range_and_exactly_the_rows_it_names_once() {
    let mut s = shard();
    let untouched = row(&s, 0, 99);
    let before = (row(&s, 0, 1), row(&s, 1, 2));
    let push = [rows(0, &[1, 3], 0.5), rows(1, &[2], -0.5)];
    let out = s
        .apply_summed(header(1, 1), &[1.0; 3], None, &push)
        .unwrap();
    assert!(matches!(out, PushOutcome::Applied { version: 1, .. }));
    assert!(s.params.iter().all(|p| *p < 0.5));
    assert!(row(&s, 0, 1).iter().zip(&before.0).all(|(a, b)| a < b));
    assert!(row(&s, 1, 2).iter().zip(&before.1).all(|(a, b)| a > b));
    assert_eq!(row(&s, 0, 99), untouched, "a row no push named");
    assert_eq!(s.table_stats()[0].0, 2);
    assert_eq!(s.table_stats()[1].0, 1);

    // A retry is acknowledged and changes nothing, rows included.
    let after = s.clone();
    let out = s
        .apply_summed(header(1, 1), &[1.0; 3], None, &push)
        .unwrap();
    assert!(matches!(out, PushOutcome::Duplicate { .. }));
    assert_eq!(s.tables, after.tables);
    assert_eq!(s.params, after.params);

    // A replaced process is refused whole.
    s.apply_summed(header(3, 1), &[0.0; 3], None, &[]).unwrap();
    let e = s.apply_summed(header(2, 9), &[1.0; 3], None, &push);
    assert!(matches!(e, Err(PsError::Superseded { .. })));
    assert_eq!(s.tables, after.tables);
}

#[test]
fn a_bad_row_refuses_the_whole_push_and_changes_nothing() {
    let mut s = shard();
    let before = s.clone();
    let mut nan = rows(1, &[4], 0.1);
    nan.values[1] = f32::NAN;
    let wrong_dim = Rows {
        values: vec![0.1; 3],
        ..rows(0, &[4], 0.1)
    };
    let twice = rows(0, &[4, 4], 0.1);
    let cases: Vec<(Vec<Rows>, &str)> = vec![
        (vec![rows(0, &[1], 0.1), nan], "not_finite"),
        (vec![wrong_dim], "wrong_length"),
        (vec![twice], "duplicate_key"),
        (
            vec![rows(0, &[1], 0.1), rows(0, &[2], 0.1)],
            "inconsistent_header",
        ),
        (vec![rows(7, &[1], 0.1)], "no_such_table"),
    ];
    for (i, (push, reason)) in cases.into_iter().enumerate() {
        let e = s
            .apply_summed(header(1, i as u64 + 1), &[1.0; 3], None, &push)
            .unwrap_err();
        assert_eq!(e.category(), reason, "{e}");
        assert_eq!(s.params, before.params);
        assert_eq!(s.tables, before.tables);
    }
    // The sequence numbers of refused pushes stay free.
    assert!(!s.has_applied(&header(1, 1).id));
    let mut sync = shard();
    sync.sync = Some(SyncRound::new(2));
    let e = sync
        .apply_summed(header(1, 1), &[1.0; 3], None, &[rows(0, &[1], 0.1)])
        .unwrap_err();
    assert_eq!(e.category(), "rows_not_taken");
}

#[test]
fn rows_arrive_in_chunks_beside_the_dense_range() {
    let enc = |v: &[f32]| distbelief_proto::codec::encode_f32(v);
    let keys = |k: &[u64]| k.iter().flat_map(|k| k.to_le_bytes()).collect::<Vec<u8>>();
    let mut a = PushAssembly::new(0..3, Vec::new(), Vec::new());
    let h = header(1, 1);
    a.add(h, 0, crate::shard::Payload::Dense(&enc(&[1.0; 3])), &[])
        .unwrap();
    a.add_rows(h, 0, &keys(&[1, 2]), &enc(&[0.5; 4]), &[])
        .unwrap();
    a.add_rows(h, 1, &keys(&[9]), &enc(&[0.5; 3]), &[]).unwrap();
    a.add_rows(h, 0, &keys(&[3]), &enc(&[0.25; 2]), &[])
        .unwrap();
    assert_eq!(a.rows.len(), 2);
    assert_eq!(a.rows[0].keys, vec![1, 2, 3]);
    assert_eq!(a.rows[0].values, vec![0.5, 0.5, 0.5, 0.5, 0.25, 0.25]);
    let e = a.add_rows(h, 0, &keys(&[4]), &enc(&[0.5; 2]), &enc(&[0.5; 2]));
    assert!(matches!(e, Err(PsError::InconsistentHeader("squares"))));
    assert!(matches!(
        a.add_rows(h, 0, &[1, 2, 3], &enc(&[0.5; 2]), &[]),
        Err(PsError::Malformed(3))
    ));
    assert!(matches!(
        a.add_rows(h, 0, &keys(&[4, 5]), &enc(&[0.5; 3]), &[]),
        Err(PsError::Malformed(12))
    ));
    let other = header(1, 2);
    assert!(matches!(
        a.add_rows(other, 0, &keys(&[4]), &enc(&[0.5; 2]), &[]),
        Err(PsError::InconsistentHeader("sequence"))
    ));
    assert_eq!(a.rows[0].keys, vec![1, 2, 3], "refused chunks add nothing");
    let mut s = shard();
    let out = s
        .apply_summed(a.finish().unwrap(), &a.values, a.squares(), &a.rows)
        .unwrap();
    assert!(matches!(out, PushOutcome::Applied { .. }));
    assert_eq!(s.table_stats()[0].0, 3);
}

#[test]
fn a_restored_shard_has_the_saved_tables_eviction_order_included() {
    let mut s = shard();
    for seq in 1..=12u64 {
        let keys: Vec<u64> = (0..3).map(|k| (seq * 7 + k * 3) % 11).collect();
        let push = [rows(0, &keys, 0.1), rows(1, &keys[..1], 0.2)];
        s.apply_summed(header(1, seq), &[0.1; 3], None, &push)
            .unwrap();
    }
    assert!(s.table_stats()[0].1.evicted > 0, "capacity 6 evicts");
    let bytes = checkpoint::write_to(Vec::new(), &s).unwrap();
    let saved = checkpoint::decode(&bytes, 0, 0..3, &configs(), "test").unwrap();
    let mut back = saved.into_shard(0, 0..3, ADAGRAD).unwrap();
    assert_eq!(back.tables, s.tables);
    assert_eq!(back.tables[0].next_eviction(), s.tables[0].next_eviction());
    // Both go on alike.
    let push = [rows(0, &[20, 21], 0.3)];
    for t in [&mut s, &mut back] {
        t.apply_summed(header(1, 13), &[0.1; 3], None, &push)
            .unwrap();
    }
    assert_eq!(back.tables, s.tables);
    assert_eq!(back.params, s.params);
    // A retry of a push from before the save is still a duplicate.
    assert!(back.has_applied(&header(1, 12).id));

    let mut fewer = configs();
    fewer.pop();
    let e = checkpoint::decode(&bytes, 0, 0..3, &fewer, "test").unwrap_err();
    assert!(
        e.to_string().contains("holds 2 tables; the job has 1"),
        "{e}"
    );
    let mut wider = configs();
    wider[0].dim = 5;
    assert!(checkpoint::decode(&bytes, 0, 0..3, &wider, "test").is_err());
}
