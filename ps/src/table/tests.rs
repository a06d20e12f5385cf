use super::*;
use distbelief_model::optimizer::adagrad;

fn config(optimizer: Optimizer) -> TableConfig {
    TableConfig {
        id: 3,
        dim: 4,
        seed: 7,
        init_scale: 0.05,
        optimizer,
        row_wise: false,
        capacity: None,
        min_count: 1,
    }
}

const SGD: Optimizer = Optimizer::Sgd { learning_rate: 0.5 };
const ADAGRAD: Optimizer = Optimizer::Adagrad {
    learning_rate: 0.1,
    initial_accumulator: 0.1,
    epsilon: 1e-8,
};

fn fetched(t: &Table, keys: &[u64]) -> Vec<f32> {
    let mut out = vec![0.0; keys.len() * t.dim()];
    t.fetch(keys, &mut out).unwrap();
    out
}

#[test]
fn keys_and_initial_rows_are_the_same_everywhere_and_differ_between_keys() {
    // Fixed values: a change here changes every saved table and model.
    assert_eq!(key_of(1, b"user-42"), key_of(1, b"user-42"));
    assert_ne!(key_of(1, b"user-42"), key_of(2, b"user-42"));
    assert_ne!(key_of(1, b"user-42"), key_of(1, b"user-43"));
    assert_eq!(
        key_of(0, b""),
        0xaca6_d6b5_4be3_ed05,
        "{:#x}",
        key_of(0, b"")
    );
    let c = config(SGD);
    let (mut a, mut b) = ([0.0; 4], [0.0; 4]);
    initial_row(&c, 11, &mut a);
    initial_row(&c, 11, &mut b);
    assert_eq!(a, b);
    assert!(a.iter().all(|v| v.abs() <= 0.05) && a.iter().any(|v| *v != 0.0));
    for other in [
        TableConfig { id: 4, ..c.clone() },
        TableConfig {
            seed: 8,
            ..c.clone()
        },
    ] {
        initial_row(&other, 11, &mut b);
        assert_ne!(a, b);
    }
    initial_row(&c, 12, &mut b);
    assert_ne!(a, b);
}

#[test]
fn keys_spread_over_the_shards() {
    let mut counts = [0u32; 4];
    for i in 0..40_000u32 {
        counts[shard_of(key_of(9, &i.to_le_bytes()), 4) as usize] += 1;
    }
    assert!(
        counts.iter().all(|&c| (9_000..11_000).contains(&c)),
        "{counts:?}"
    );
    assert_eq!(shard_of(123, 1), 0);
}

#[test]
fn a_push_updates_exactly_the_rows_it_names_and_a_fetch_changes_nothing() {
    let mut t = Table::new(config(SGD));
    let untouched = fetched(&t, &[5, 6]);
    let before = t.clone();
    assert_eq!(fetched(&t, &[1, 2]), fetched(&t, &[1, 2]));
    assert_eq!(t, before, "a fetch stores nothing");
    let start = fetched(&t, &[1, 2]);
    let g = [1.0, 0.0, -1.0, 2.0, 0.5, 0.5, 0.5, 0.5];
    assert_eq!(t.apply(&[1, 2], &g, None, 1).unwrap(), 2);
    let after = fetched(&t, &[1, 2]);
    for i in 0..8 {
        assert!((after[i] - (start[i] - 0.5 * g[i])).abs() < 1e-7);
    }
    assert_eq!(fetched(&t, &[5, 6]), untouched);
    assert_eq!((t.len(), t.stats().created), (2, 2));
}

#[test]
fn adagrad_rows_follow_the_dense_rule_and_row_wise_keeps_one_accumulator() {
    let mut t = Table::new(config(ADAGRAD));
    let mut p = fetched(&t, &[9]);
    let mut a = vec![0.1; 4];
    for g in [[0.3, -0.2, 0.0, 1.0], [0.1, 0.1, 0.1, 0.1]] {
        t.apply(&[9], &g, None, 1).unwrap();
        adagrad(&mut p, &mut a, &g, 0.1, 1e-8);
    }
    assert_eq!(fetched(&t, &[9]), p);

    let row_wise = TableConfig {
        row_wise: true,
        ..config(Optimizer::Adagrad {
            learning_rate: 0.1,
            initial_accumulator: 0.1,
            epsilon: 0.0,
        })
    };
    let mut t = Table::new(row_wise);
    let p0 = fetched(&t, &[9]);
    let g = [0.2, 0.4, 0.0, 0.0];
    t.apply(&[9], &g, None, 1).unwrap();
    // a = 0.1 + (0.04 + 0.16) / 4 = 0.15
    let step = 0.1 / 0.15f32.sqrt();
    let p1 = fetched(&t, &[9]);
    for i in 0..4 {
        assert!((p1[i] - (p0[i] - step * g[i])).abs() < 1e-6, "{p1:?}");
    }
    assert_eq!(t.row(9).map(|r| r.1.len()), Some(1));
}

#[test]
fn a_full_table_evicts_its_least_used_row_and_the_oldest_among_equals() {
    let mut t = Table::new(TableConfig {
        capacity: Some(3),
        ..config(SGD)
    });
    let g = [0.1; 4];
    for key in [1, 2, 3] {
        t.apply(&[key], &g, None, 1).unwrap();
    }
    t.apply(&[1], &g, None, 1).unwrap();
    t.apply(&[3], &g, None, 1).unwrap();
    // 2 was used once, 1 and 3 twice: 2 goes.
    assert_eq!(t.next_eviction(), Some(2));
    t.apply(&[4], &g, None, 1).unwrap();
    assert!(!t.contains(2) && t.contains(4) && t.len() == 3);
    // 4 now has one use: it goes before 1 and 3; among equals, the older.
    assert_eq!(t.next_eviction(), Some(4));
    t.apply(&[5], &g, None, 1).unwrap();
    assert_eq!(t.next_eviction(), Some(5));
    assert_eq!(t.stats().evicted, 2);
    // An evicted row comes back as it started.
    let mut fresh = [0.0; 4];
    initial_row(t.config(), 2, &mut fresh);
    assert_eq!(fetched(&t, &[2]), fresh);
}

#[test]
fn a_key_gets_a_row_only_after_its_minimum_count_of_pushes() {
    let mut t = Table::new(TableConfig {
        min_count: 3,
        ..config(SGD)
    });
    let start = fetched(&t, &[8]);
    assert_eq!(t.apply(&[8], &[1.0; 4], None, 1).unwrap(), 0);
    assert_eq!(t.apply(&[8], &[1.0; 4], None, 1).unwrap(), 0);
    assert_eq!(fetched(&t, &[8]), start, "not admitted yet: unchanged");
    assert_eq!(t.apply(&[8], &[1.0; 4], None, 1).unwrap(), 1);
    assert!(t.contains(8));
    assert_eq!(
        t.stats(),
        TableStats {
            created: 1,
            evicted: 0,
            refused: 2
        }
    );
}

#[test]
fn a_bad_push_is_refused_whole_and_changes_nothing() {
    let mut t = Table::new(config(ADAGRAD));
    t.apply(&[1], &[0.1; 4], None, 1).unwrap();
    let before = t.clone();
    /// Keys, gradients, squares, and the refusal's category.
    type Case = (Vec<u64>, Vec<f32>, Option<Vec<f32>>, &'static str);
    let cases: Vec<Case> = vec![
        (vec![2, 3], vec![0.1; 4], None, "wrong_length"),
        (vec![2, 2], vec![0.1; 8], None, "duplicate_key"),
        (
            vec![2, 1],
            [[0.1; 4], [f32::NAN, 0.0, 0.0, 0.0]].concat(),
            None,
            "not_finite",
        ),
        (vec![2], vec![0.1; 4], Some(vec![-1.0; 4]), "not_finite"),
        (vec![2], vec![0.1; 4], Some(vec![0.0; 3]), "wrong_length"),
    ];
    for (keys, g, sq, category) in cases {
        let e = t.apply(&keys, &g, sq.as_deref(), 2).unwrap_err();
        assert_eq!(e.category(), category, "{e}");
        assert_eq!(t, before);
    }
}

#[test]
fn a_restored_table_equals_the_saved_one_eviction_order_included() {
    let mut t = Table::new(TableConfig {
        capacity: Some(5),
        min_count: 2,
        ..config(ADAGRAD)
    });
    for round in 0..4u64 {
        for key in 0..(3 + round) {
            let g: Vec<f32> = (0..4).map(|i| (key * 4 + i) as f32 / 100.0).collect();
            t.apply(&[key * 7 + round % 2], &g, None, 1).unwrap();
        }
    }
    assert!(
        t.stats().evicted > 0 && t.pending.len() > 0,
        "{:?}",
        t.stats()
    );
    let bytes = encode(&t);
    let mut back = decode(&bytes, t.config(), "saved").unwrap();
    assert_eq!(back, t);
    assert_eq!(encode(&back), bytes);
    // They go on alike: the same row is evicted next.
    let mut orig = t.clone();
    for key in [100, 101] {
        orig.apply(&[key], &[0.1; 4], None, 1).unwrap();
        back.apply(&[key], &[0.1; 4], None, 1).unwrap();
    }
    assert_eq!(back, orig);
}

/// Restore accepts whatever apply can produce: a finite gradient whose
/// square (or whose step) passes f32::MAX saturates there instead of
/// leaving an inf that no restore or catch-up would take back.
#[test]
fn a_huge_finite_gradient_leaves_every_optimizer_s_table_restorable() {
    let huge = 3.0e19_f32;
    // SGD's step passes f32::MAX only with a large learning rate.
    let sgd = Optimizer::Sgd {
        learning_rate: 1.0e20,
    };
    for (o, row_wise) in [(sgd, false), (ADAGRAD, false), (ADAGRAD, true)] {
        let mut t = Table::new(TableConfig {
            row_wise,
            ..config(o)
        });
        for _ in 0..3 {
            t.apply(
                &[1, 2],
                &[huge, -huge, 1.0, 0.5, -huge, huge, 2.0, 0.0],
                None,
                1,
            )
            .unwrap();
        }
        t.apply(&[1], &[huge; 4], Some(&[f32::MAX; 4]), 2).unwrap();
        let bytes = encode(&t);
        let back = decode(&bytes, t.config(), "saved")
            .unwrap_or_else(|e| panic!("{o:?} row_wise={row_wise}: {e}"));
        assert_eq!(back, t);
        assert!(fetched(&t, &[1, 2]).iter().all(|v| v.is_finite()));
    }
}

#[test]
fn a_damaged_or_foreign_table_state_is_refused_with_the_reason() {
    let mut t = Table::new(config(ADAGRAD));
    t.apply(&[1, 2], &[0.1; 8], None, 1).unwrap();
    let bytes = encode(&t);
    let refused = |b: &[u8], c: &TableConfig| decode(b, c, "t.bin").unwrap_err().to_string();
    assert!(refused(&bytes[..bytes.len() - 1], t.config()).contains("checksum"));
    let mut flipped = bytes.clone();
    flipped[30] ^= 1;
    assert!(refused(&flipped, t.config()).contains("checksum"));
    let other = TableConfig {
        dim: 8,
        ..t.config().clone()
    };
    assert!(refused(&bytes, &other).contains("rows of 4"));
    let small = TableConfig {
        capacity: Some(1),
        ..t.config().clone()
    };
    assert!(refused(&bytes, &small).contains("capacity"));
    // A row count that the bytes cannot hold is refused before allocating.
    let mut huge = bytes[..60].to_vec();
    huge[52..60].copy_from_slice(&u64::MAX.to_le_bytes());
    let crc = crc32fast::hash(&huge);
    huge.extend_from_slice(&crc.to_le_bytes());
    assert!(
        refused(&huge, t.config()).contains("claims"),
        "{}",
        refused(&huge, t.config())
    );
}

#[test]
fn a_full_set_of_pending_keys_forgets_the_oldest_so_new_keys_still_count() {
    let mut p = Pending::default();
    for key in 0..MAX_PENDING as u64 {
        assert_eq!(p.bump(key, key), 1);
    }
    assert_eq!(p.bump(5, 99), 2, "a tracked key counts on");
    // Full: a new key makes room by forgetting key 0, first seen longest ago.
    assert_eq!(p.bump(u64::MAX, 1 << 30), 1);
    assert_eq!(p.len(), MAX_PENDING);
    assert!(!p.counts.contains_key(&0) && p.counts.contains_key(&1));
    assert_eq!(p.bump(u64::MAX, 1 << 30), 2);
}

/// Pages through `t` two rows at a time, as the export RPC does.
fn exported(t: &Table) -> Vec<(u64, Vec<f32>)> {
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    let mut from = Some(0);
    while let Some(at) = from {
        let before = keys.len();
        from = t.export(at, 2, &mut keys, &mut values);
        assert!(
            keys.len() - before <= 2,
            "a page holds at most what was asked"
        );
    }
    let mut rows: Vec<(u64, Vec<f32>)> = keys
        .iter()
        .zip(values.chunks_exact(t.dim()))
        .map(|(&k, v)| (k, v.to_vec()))
        .collect();
    rows.sort_by_key(|r| r.0);
    rows
}

#[test]
fn an_export_pages_through_every_stored_row_once_and_skips_freed_slots() {
    let g = [0.1; 4];
    let mut t = Table::new(config(ADAGRAD));
    assert!(exported(&t).is_empty());
    for key in [9, 4, 7, 1, 3] {
        t.apply(&[key], &g, None, 1).unwrap();
    }
    let rows = exported(&t);
    assert_eq!(
        rows.iter().map(|r| r.0).collect::<Vec<_>>(),
        [1, 3, 4, 7, 9]
    );
    for (key, values) in &rows {
        assert_eq!(&fetched(&t, &[*key]), values, "key {key}");
    }
    // A capped table frees slots on eviction and reuses them.
    let mut t = Table::new(TableConfig {
        capacity: Some(3),
        ..config(SGD)
    });
    for key in [1, 2, 3, 1, 3, 4, 5, 6] {
        t.apply(&[key], &g, None, 1).unwrap();
    }
    let keys: Vec<u64> = exported(&t).iter().map(|r| r.0).collect();
    let mut stored: Vec<u64> = (1..=6).filter(|&k| t.contains(k)).collect();
    stored.sort();
    assert_eq!(keys, stored);
    assert_eq!(keys.len(), 3);
}
