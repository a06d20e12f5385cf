//! The job file: YAML text to a validated job, as `distbelief train` and
//! every role read it.

use distbelief_api::{DistBeliefJob, Job, parse_job};

pub fn job_file(data: &[u8]) {
    // The loader reads the file as UTF-8 text; other bytes never reach the parser.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(job) = parse_job("fuzz.yaml", text) else {
        return;
    };
    check_ranges(&job);
    // A validated job written back out is the same job: what the operator
    // stores and the local runtime reads agree.
    let resource = DistBeliefJob::new(&job.name, job.spec.clone());
    let yaml = serde_norway::to_string(&resource).expect("a validated job serialises");
    let again = parse_job("again.yaml", &yaml)
        .unwrap_or_else(|e| panic!("a validated job, written back, fails: {e}\n{yaml}"));
    assert_eq!(again.spec, job.spec, "the job changed on the way round");
    assert_eq!(again.layout, job.layout);
}

fn check_ranges(job: &Job) {
    let ranges = job.shard_ranges();
    assert_eq!(ranges.len(), job.shards(), "one range per shard");
    let mut next = 0;
    for r in &ranges {
        assert_eq!(r.start, next, "ranges are contiguous");
        assert!(
            r.end > r.start,
            "validation leaves no shard empty: {ranges:?}"
        );
        next = r.end;
    }
    assert_eq!(next, job.layout.len(), "the ranges cover every parameter");
    assert!(job.partitions() >= 1);
}
