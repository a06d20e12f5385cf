//! Sandblaster's exactly-once rule with the real pieces and no network: the
//! coordinator's portion scheduler hands a batch out to three replicas; one
//! is slow (so its portion is backed up, and its late commit is refused), one
//! dies after pushing its grant to only one of the two shards (so the grant is
//! redone whole under the same id, and the shard that had it keeps one copy).
//! The batch gradient the shards hold must equal the full-batch gradient.

use std::ops::Range;

use distbelief_coordinator::portions::{Batch, Commit, Counts, Work};
use distbelief_model::data::{self, Dataset};
use distbelief_model::{Mlp, Optimizer};
use distbelief_ps::Shard;
use distbelief_ps::shard::{PushHeader, PushId};
use distbelief_ps_client::vectors::{Vector, dot};

const PORTION: usize = 100;

struct World {
    mlp: Mlp,
    data: Dataset,
    params: Vec<f32>,
    ranges: Vec<Range<usize>>,
    shards: Vec<Shard>,
    sequence: u64,
}

impl World {
    /// The summed gradient of `rows`.
    fn gradient_sum(&self, rows: Range<usize>) -> Vec<f32> {
        let n = rows.len();
        let x = ndarray::ArrayView2::from_shape(
            (n, self.data.dim),
            &self.data.features[rows.start * self.data.dim..rows.end * self.data.dim],
        )
        .expect("rows");
        let mut ws = self.mlp.workspaces(n, 1);
        let mut grad = vec![0.0; self.params.len()];
        self.mlp
            .batch_gradient(&self.params, x, &self.data.labels[rows], &mut ws, &mut grad);
        grad.iter_mut().for_each(|g| *g *= n as f32);
        grad
    }

    /// What a replica computes for the portions it pushes together.
    fn portions_sum(&self, portions: &[u32]) -> Vec<f32> {
        let mut sum = vec![0.0; self.params.len()];
        for p in portions {
            let start = *p as usize * PORTION;
            for (s, g) in sum
                .iter_mut()
                .zip(self.gradient_sum(start..start + PORTION))
            {
                *s += g;
            }
        }
        sum
    }

    /// Pushes `sum` under `grant` to the shards listed.
    fn push(&mut self, replica: u32, grant: u64, sum: &[f32], to: &[usize]) {
        for &i in to {
            self.sequence += 1;
            let h = PushHeader {
                shard: i as u32,
                id: PushId {
                    replica,
                    incarnation: 1,
                    sequence: self.sequence,
                    base: Default::default(),
                    steps: 1,
                    fence: 0,
                    average: false,
                    grant: Some(grant),
                },
            };
            let r = self.ranges[i].clone();
            self.shards[i].apply_push(h, &sum[r]).expect("push");
        }
    }
}

/// `replica` takes work until the scheduler has none for it, committing
/// and pushing every two portions, or fewer when no more are coming.
fn run(world: &mut World, batch: &mut Batch, replica: u32) {
    let mut held = Vec::new();
    loop {
        match batch.next(replica) {
            Work::Portion(p) => {
                held.push(p);
                if held.len() < 2 {
                    continue;
                }
            }
            Work::Redo { grant, portions } => {
                let sum = world.portions_sum(&portions);
                world.push(replica, grant, &sum, &[0, 1]);
                batch.pushed(grant);
                continue;
            }
            Work::Wait | Work::Done if held.is_empty() => return,
            Work::Wait | Work::Done => {}
        }
        let portions = std::mem::take(&mut held);
        if let Commit::Granted(grant) = batch.commit(replica, &portions) {
            let sum = world.portions_sum(&portions);
            world.push(replica, grant, &sum, &[0, 1]);
            batch.pushed(grant);
        }
    }
}

#[test]
fn with_a_backup_and_a_replica_killed_mid_push_every_portion_counts_once() {
    distbelief_tests::require_fashion_mnist();
    let job = distbelief_tests::softmax_regression_job("exactly-once", 2000, 2);
    let data = data::load(&job.spec.data, true).expect("Fashion-MNIST");
    let n = job.layout.len();
    let params = job.layout.initial_values(0..n, job.downpour.seed);
    let ranges = job.layout.shard_ranges(2);
    let shards = ranges
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let sgd = Optimizer::Sgd { learning_rate: 0.1 };
            Shard::new(i as u32, r.clone(), sgd, params[r.clone()].to_vec())
        })
        .collect();
    let portions = (data.len() / PORTION) as u32;
    let mut world = World {
        mlp: Mlp::new(&job.layout),
        data,
        params,
        ranges,
        shards,
        sequence: 0,
    };
    let mut batch = Batch::new(portions, 0.9, 1);

    // Replica 1 is slow: it takes a portion and does not come back until
    // the end. Replica 2 takes two, commits, reaches shard 0 only, and dies.
    let slow = match batch.next(1) {
        Work::Portion(p) => p,
        w => panic!("{w:?}"),
    };
    let dying: Vec<u32> = (0..2)
        .map(|_| match batch.next(2) {
            Work::Portion(p) => p,
            w => panic!("{w:?}"),
        })
        .collect();
    let Commit::Granted(grant) = batch.commit(2, &dying) else {
        panic!("first commit of those portions");
    };
    let sum = world.portions_sum(&dying);
    world.push(2, grant, &sum, &[0]);
    batch.lost(2);

    // Replica 0 does everything else: the dead replica's grant again, its
    // own portions, then a backup of the slow replica's.
    run(&mut world, &mut batch, 0);
    assert!(batch.is_done(), "the batch finished without replica 1");
    assert_eq!(
        batch.commit(1, &[slow]),
        Commit::Refused,
        "the straggler's late result is dropped"
    );
    assert_eq!(
        batch.counts,
        Counts {
            backups_issued: 1,
            backups_used: 1,
            refused: 1,
            redone: 1
        }
    );

    let full = world.gradient_sum(0..portions as usize * PORTION);
    let held: Vec<f32> = world
        .shards
        .iter()
        .flat_map(|s| {
            s.vectors()
                .values(Vector::Gradient)
                .expect("the shard holds a batch gradient")
                .to_vec()
        })
        .collect();
    let diff: Vec<f32> = held.iter().zip(&full).map(|(a, b)| a - b).collect();
    let relative = (dot(&diff, &diff) / dot(&full, &full)).sqrt();
    eprintln!("batch gradient vs full-batch gradient: relative difference {relative:.1e}");
    // Had shard 0 taken the redone grant twice, two portions of twenty
    // would count double: a difference of about a tenth.
    assert!(relative <= 1e-5, "relative difference {relative:.1e}");
}
