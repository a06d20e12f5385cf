//! Where data files are read from: a local path, or an object store URL
//! (`s3://`, `gs://`, `az://`, `abfs://`, `http(s)://`) through arrow-rs's
//! `object_store`. Readers see one [`DataFile`]: bytes by offset, so that a
//! data shard (a Parquet row group, a byte range of a text file) fetches
//! only its own part of an object, a few MiB at a time.
//!
//! Credentials and endpoints come from the process's environment, under the
//! names each store's own tools use (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`,
//! `AWS_ALLOW_HTTP`, `GOOGLE_SERVICE_ACCOUNT`, `AZURE_STORAGE_ACCOUNT_NAME`,
//! ...), so a pod template's env or a Secret sets them.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt};

use super::DataError;

/// Bytes one fetch from an object store asks for: large enough that a
/// request's latency hides behind decoding, small enough that a replica's
/// memory does not notice (two are held: the one read and the next).
const FETCH_BYTES: u64 = 4 << 20;

/// Whether `path` names an object in a store rather than a local file.
pub fn is_url(path: &str) -> bool {
    path.split_once("://").is_some_and(|(scheme, _)| {
        !scheme.is_empty() && scheme.bytes().all(|b| b.is_ascii_alphanumeric())
    })
}

/// A data file, local or in an object store.
#[derive(Debug)]
pub enum DataFile {
    Local(File),
    Remote(Object),
}

/// An object: its store, key and length. Cheap to clone; clones share the
/// bytes preloaded.
#[derive(Clone)]
pub struct Object {
    store: Arc<dyn ObjectStore>,
    key: Key,
    url: String,
    len: u64,
    /// A span fetched whole (a Parquet row group's column chunks), served
    /// to the decoder's many small reads without a request each.
    preloaded: Arc<std::sync::Mutex<Option<(u64, Bytes)>>>,
}

impl Object {
    /// Fetches `range` in one request; reads inside it are served from it.
    pub fn preload(&self, range: std::ops::Range<u64>) -> Result<(), DataError> {
        let end = range.end.min(self.len);
        let (store, key) = (self.store.clone(), self.key.clone());
        let start = range.start.min(end);
        let bytes = call(
            &self.url,
            async move { store.get_range(&key, start..end).await },
        )?;
        *self.preloaded.lock().unwrap_or_else(|p| p.into_inner()) = Some((start, bytes));
        Ok(())
    }

    /// The preloaded bytes from `at` to the span's end, when `at` is in it.
    fn preloaded_from(&self, at: u64) -> Option<Bytes> {
        let held = self.preloaded.lock().unwrap_or_else(|p| p.into_inner());
        let (start, bytes) = held.as_ref()?;
        (at >= *start && at < start + bytes.len() as u64)
            .then(|| bytes.slice((at - start) as usize..))
    }

    fn preloaded_span(&self, start: u64, end: u64) -> Option<Bytes> {
        let held = self.preloaded.lock().unwrap_or_else(|p| p.into_inner());
        let (at, bytes) = held.as_ref()?;
        (start >= *at && end <= at + bytes.len() as u64)
            .then(|| bytes.slice((start - at) as usize..(end - at) as usize))
    }
}

impl std::fmt::Debug for Object {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({} bytes)", self.url, self.len)
    }
}

fn store_error(url: &str, e: object_store::Error) -> DataError {
    let kind = match e {
        object_store::Error::NotFound { .. } => io::ErrorKind::NotFound,
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => io::ErrorKind::PermissionDenied,
        _ => io::ErrorKind::Other,
    };
    DataError::Io {
        path: url.to_string(),
        source: io::Error::new(kind, e.to_string()),
    }
}

/// The runtime every object store request runs on. Readers are plain
/// threads (and sometimes a tokio task's thread): they wait on a channel,
/// never on a runtime of their own, so they may be called from anywhere.
fn runtime() -> io::Result<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    let built = RUNTIME.get_or_init(|| {
        // reqwest is built without a default TLS provider: the tree's
        // rustls uses ring, and one provider serves every role.
        let _ = rustls::crypto::ring::default_provider().install_default();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("object-store")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    });
    built.as_ref().map_err(|e| {
        io::Error::other(format!(
            "cannot start the threads for object store requests: {e}"
        ))
    })
}

/// Runs `f` on the object store runtime and waits for it. A request that
/// ends without an answer (its task panicked) is an error, not a hang.
fn wait<T: Send + 'static>(f: impl Future<Output = T> + Send + 'static) -> io::Result<T> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    runtime()?.spawn(async move {
        let _ = tx.send(f.await);
    });
    rx.recv()
        .map_err(|_| io::Error::other("an object store request ended without an answer"))
}

/// One request to the store behind `url`; its errors name the URL.
fn call<T: Send + 'static>(
    url: &str,
    f: impl Future<Output = object_store::Result<T>> + Send + 'static,
) -> Result<T, DataError> {
    wait(f)
        .map_err(|source| DataError::Io {
            path: url.to_string(),
            source,
        })?
        .map_err(|e| store_error(url, e))
}

/// The store a URL names and the key within it. The store's settings are
/// the environment's variables with its prefix (`AWS_`, `GOOGLE_`, `AZURE_`).
fn store_of(url: &str) -> Result<(Arc<dyn ObjectStore>, Key), DataError> {
    let bad = |message: String| DataError::Format {
        path: url.to_string(),
        message,
    };
    // Building a store builds its HTTP client, which needs the TLS
    // provider the runtime installs.
    runtime().map_err(|source| DataError::Io {
        path: url.to_string(),
        source,
    })?;
    let parsed = url::Url::parse(url).map_err(|e| bad(format!("is not a valid URL: {e}")))?;
    let settings = std::env::vars().filter(|(k, _)| {
        ["AWS_", "GOOGLE_", "AZURE_"]
            .iter()
            .any(|p| k.starts_with(p))
    });
    let (store, key) = object_store::parse_url_opts(&parsed, settings).map_err(|e| {
        bad(format!(
            "names no object store this build reads (s3, gs, az, abfs, http, https): {e}"
        ))
    })?;
    Ok((Arc::from(store), key))
}

/// Opens a data file.
pub fn open(path: &str) -> Result<DataFile, DataError> {
    if !is_url(path) {
        let file = File::open(path).map_err(|source| DataError::Io {
            path: path.to_string(),
            source,
        })?;
        return Ok(DataFile::Local(file));
    }
    let (store, key) = store_of(path)?;
    let (s, k) = (store.clone(), key.clone());
    let meta = call(path, async move { s.head(&k).await })?;
    Ok(DataFile::Remote(Object {
        store,
        key,
        url: path.to_string(),
        len: meta.size,
        preloaded: Default::default(),
    }))
}

/// The objects a URL names: the object itself, or, when there is none, the
/// objects directly under it as a folder, or those a glob in its last
/// part matches; sorted, with names starting `.` or `_` left out.
pub fn list(url: &str) -> Result<Vec<String>, DataError> {
    let (store, key) = store_of(url)?;
    let glob = distbelief_api::is_glob(url);
    if !glob {
        let (s, k) = (store.clone(), key.clone());
        let head = wait(async move { s.head(&k).await }).map_err(|source| DataError::Io {
            path: url.to_string(),
            source,
        })?;
        match head {
            Ok(_) => return Ok(vec![url.to_string()]),
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(store_error(url, e)),
        }
    }
    let (folder, pattern) = match glob {
        true => {
            let (folder, name) = url.rsplit_once('/').unwrap_or(("", url));
            let pattern = glob::Pattern::new(name).map_err(|e| DataError::Format {
                path: url.to_string(),
                message: format!("is not a valid glob: {e}"),
            })?;
            (store_of(folder)?.1, Some(pattern))
        }
        false => (key, None),
    };
    let prefix = (!folder.as_ref().is_empty()).then(|| folder.clone());
    let s = store.clone();
    let listed = call(
        url,
        async move { s.list_with_delimiter(prefix.as_ref()).await },
    )?;
    let base = url.trim_end_matches('/');
    let base = match glob {
        true => base.rsplit_once('/').map_or(base, |(b, _)| b),
        false => base,
    };
    let mut files: Vec<String> = listed
        .objects
        .iter()
        .filter_map(|o| o.location.filename())
        .filter(|n| !n.starts_with('.') && !n.starts_with('_'))
        .filter(|n| pattern.as_ref().is_none_or(|p| p.matches(n)))
        .map(|n| format!("{base}/{n}"))
        .collect();
    files.sort();
    Ok(files)
}

/// A data file's whole contents (the in-memory readers').
pub fn read_all(path: &str) -> Result<Vec<u8>, DataError> {
    if !is_url(path) {
        return std::fs::read(Path::new(path)).map_err(|source| DataError::Io {
            path: path.to_string(),
            source,
        });
    }
    let mut out = Vec::new();
    open(path)?
        .reader(0)
        .read_to_end(&mut out)
        .map_err(|source| DataError::Io {
            path: path.to_string(),
            source,
        })?;
    Ok(out)
}

/// Copies local file `from` to the object `to` (a multipart upload when it
/// is large, as stores require past 5 GiB); returns the bytes copied.
pub fn upload(from: &Path, to: &str) -> Result<u64, DataError> {
    use tokio::io::AsyncWriteExt;
    let (store, key) = store_of(to)?;
    let mut file = File::open(from).map_err(|source| DataError::Io {
        path: from.display().to_string(),
        source,
    })?;
    // Chunks go to the runtime through a bounded channel; None says the
    // file could not be read, and the upload is aborted rather than
    // completed short.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Option<Bytes>>(2);
    let writer = runtime()
        .map_err(|source| DataError::Write {
            path: to.to_string(),
            source,
        })?
        .spawn(async move {
            let mut w = object_store::buffered::BufWriter::new(store, key);
            while let Some(chunk) = rx.recv().await {
                let written = match chunk {
                    Some(c) => w.write_all(&c).await,
                    None => Err(io::Error::other("the file could not be read")),
                };
                if let Err(e) = written {
                    let _ = w.abort().await;
                    return Err(e);
                }
            }
            w.shutdown().await
        });
    let mut copied = 0u64;
    let mut buf = vec![0u8; FETCH_BYTES as usize];
    let read = loop {
        match file.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => {
                copied += n as u64;
                if tx
                    .blocking_send(Some(Bytes::copy_from_slice(&buf[..n])))
                    .is_err()
                {
                    break Ok(());
                }
            }
            Err(e) => {
                let _ = tx.blocking_send(None);
                break Err(e);
            }
        }
    };
    drop(tx);
    read.map_err(|source| DataError::Io {
        path: from.display().to_string(),
        source,
    })?;
    let io = |source| DataError::Write {
        path: to.to_string(),
        source,
    };
    wait(writer)
        .map_err(io)?
        .map_err(|e| io(io::Error::other(e.to_string())))?
        .map_err(io)?;
    Ok(copied)
}

impl DataFile {
    /// The object behind a remote file, to preload spans of.
    pub fn remote(&self) -> Option<Object> {
        match self {
            DataFile::Local(_) => None,
            DataFile::Remote(o) => Some(o.clone()),
        }
    }

    /// The file's length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            DataFile::Local(f) => f.metadata().map_or(0, |m| m.len()),
            DataFile::Remote(o) => o.len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A reader of the file from byte `start` on, which can seek.
    pub fn reader(&self, start: u64) -> Reader {
        match self {
            DataFile::Local(f) => Reader::Local(f.try_clone().and_then(|mut f| {
                f.seek(SeekFrom::Start(start))?;
                Ok(f)
            })),
            DataFile::Remote(o) => Reader::Remote(Fetcher {
                object: o.clone(),
                pos: start,
                chunk: Bytes::new(),
                chunk_at: 0,
                next: None,
            }),
        }
    }
}

/// A sequential reader of a data file (see [`DataFile::reader`]).
pub enum Reader {
    /// The opened file, or why it could not be cloned (reported on read).
    Local(io::Result<File>),
    Remote(Fetcher),
}

impl Read for Reader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Reader::Local(Ok(f)) => f.read(buf),
            Reader::Local(Err(e)) => Err(io::Error::new(e.kind(), e.to_string())),
            Reader::Remote(r) => r.read(buf),
        }
    }
}

impl Seek for Reader {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        match self {
            Reader::Local(Ok(f)) => f.seek(to),
            Reader::Local(Err(e)) => Err(io::Error::new(e.kind(), e.to_string())),
            Reader::Remote(r) => r.seek(to),
        }
    }
}

type Pending = std::sync::mpsc::Receiver<object_store::Result<Bytes>>;

/// Reads an object a chunk at a time, asking for the next chunk while the
/// caller decodes this one.
pub struct Fetcher {
    object: Object,
    pos: u64,
    chunk: Bytes,
    chunk_at: u64,
    next: Option<(u64, Pending)>,
}

impl Fetcher {
    fn ask(&self, at: u64) -> io::Result<Pending> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let (store, key) = (self.object.store.clone(), self.object.key.clone());
        let end = (at + FETCH_BYTES).min(self.object.len);
        runtime()?.spawn(async move {
            let _ = tx.send(store.get_range(&key, at..end).await);
        });
        Ok(rx)
    }

    fn fill(&mut self) -> io::Result<()> {
        let at = self.pos;
        // The Parquet decoder reads each column chunk through a reader:
        // inside a preloaded row group, that costs no request.
        if let Some(rest) = self.object.preloaded_from(at) {
            self.chunk = rest;
            self.chunk_at = at;
            self.next = None;
            return Ok(());
        }
        let pending = match self.next.take() {
            Some((next_at, rx)) if next_at == at => rx,
            _ => self.ask(at)?,
        };
        let got = pending
            .recv()
            .map_err(|_| io::Error::other("the object store runtime has stopped"))?;
        self.chunk = got.map_err(|e| io::Error::other(format!("{}: {e}", self.object.url)))?;
        self.chunk_at = at;
        let after = at + self.chunk.len() as u64;
        if after < self.object.len && !self.chunk.is_empty() {
            // A failed ask ahead is asked again, and reported, when needed.
            self.next = self.ask(after).ok().map(|rx| (after, rx));
        }
        Ok(())
    }
}

impl Read for Fetcher {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos >= self.object.len || buf.is_empty() {
            return Ok(0);
        }
        let end = self.chunk_at + self.chunk.len() as u64;
        if self.pos < self.chunk_at || self.pos >= end {
            self.fill()?;
        }
        let from = (self.pos - self.chunk_at) as usize;
        let n = buf.len().min(self.chunk.len() - from);
        buf[..n].copy_from_slice(&self.chunk[from..from + n]);
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for Fetcher {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let pos = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.object.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = pos.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "seek before the object's start",
            )
        })?;
        Ok(self.pos)
    }
}

impl parquet::file::reader::Length for DataFile {
    fn len(&self) -> u64 {
        DataFile::len(self)
    }
}

impl parquet::file::reader::ChunkReader for DataFile {
    type T = io::Take<Reader>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        Ok(self.reader(start).take(u64::MAX))
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        match self {
            DataFile::Local(f) => f.get_bytes(start, length),
            DataFile::Remote(o) => {
                let end = start.saturating_add(length as u64);
                if end > o.len {
                    return Err(parquet::errors::ParquetError::EOF(format!(
                        "{}: bytes {start}..{end} past its end ({})",
                        o.url, o.len
                    )));
                }
                if let Some(held) = o.preloaded_span(start, end) {
                    return Ok(held);
                }
                let (store, key) = (o.store.clone(), o.key.clone());
                call(
                    &o.url,
                    async move { store.get_range(&key, start..end).await },
                )
                .map_err(|e| parquet::errors::ParquetError::External(Box::new(e)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_told_from_paths() {
        for url in ["s3://b/k", "gs://b/k", "az://c/k", "https://h/f.tsv"] {
            assert!(is_url(url), "{url}");
        }
        for path in ["/data/train.tsv", "train.tsv", "./a://b", ""] {
            assert!(!is_url(path), "{path}");
        }
    }

    #[test]
    fn a_scheme_no_store_serves_is_a_clear_error() {
        let e = open("ftp://host/train.tsv").unwrap_err().to_string();
        assert!(e.contains("ftp://host/train.tsv"), "{e}");
        assert!(e.contains("names no object store"), "{e}");
    }

    #[test]
    fn a_local_reader_seeks_and_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"0123456789").unwrap();
        let file = open(path.to_str().unwrap()).unwrap();
        assert_eq!(file.len(), 10);
        let mut s = String::new();
        file.reader(4).read_to_string(&mut s).unwrap();
        assert_eq!(s, "456789");
    }
}
