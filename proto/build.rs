fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=distbelief/v1/distbelief.proto");
    tonic_prost_build::configure()
        // Tensor payloads stay as `Bytes` so that chunks are sliced, not copied.
        .bytes(".distbelief.v1")
        .compile_protos(&["distbelief/v1/distbelief.proto"], &["."])?;
    Ok(())
}
