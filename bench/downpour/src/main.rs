mod local;
mod micro;

fn main() -> anyhow::Result<()> {
    let job = distbelief_api::parse_job("micro", micro::TEN_MILLION_JOB)?;
    println!("adagrad {:.2} Gparam/s", micro::adagrad_gparams_per_second(job.layout.len(), 2.0));
    let file = std::env::temp_dir().join("dbj-micro.yaml");
    std::fs::write(&file, micro::TEN_MILLION_JOB)?;
    let exe = std::env::current_exe()?.with_file_name("distbelief");
    let t = micro::fetch_push(&exe, &file, &job, 20)?;
    println!("fetch+push {:.2} GB/s rss {} state {}", t.gb_per_second, t.shard_peak_rss_bytes, t.shard_state_bytes);
    Ok(())
}
