//! Reference pages generated from the CRD's schema, whose text is the
//! spec's `///` docs: the field reference (docs/reference.md) and the table
//! of layer kinds in docs/job-spec.md. Tests compare the committed text with
//! this, so the docs cannot drift from the code.

use serde_json::Value;

/// The markdown table of the layer kinds a `spec.model.layers` entry may
/// set, and their fields.
pub fn layers_table() -> String {
    let crd = serde_json::to_value(crate::crd()).expect("the CRD serializes");
    let kinds = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ["model"]["properties"]["layers"]["items"]["properties"];
    let mut out = String::from("| Key | Field | Type | Meaning |\n|---|---|---|---|\n");
    for (kind, schema) in kinds.as_object().expect("layer kinds are properties") {
        out += &format!("| `{kind}` | | | {} |\n", one_line(&schema["description"]));
        if let Some(fields) = schema["properties"].as_object() {
            for (field, f) in fields {
                out += &format!(
                    "| | `{field}` | {} | {} |\n",
                    type_of(f),
                    one_line(&f["description"])
                );
            }
        }
    }
    out
}

/// The whole job spec, one section per object, every field with its type
/// and its `///` doc (docs/reference.md).
pub fn spec_reference() -> String {
    let crd = serde_json::to_value(crate::crd()).expect("the CRD serializes");
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let mut out = String::from(
        "# Job spec reference\n\n\
         Every field of a `DistBeliefJob`'s `spec`, generated from the CRD's schema, whose text is the \
         `///` docs of `api/src/spec.rs`: this is what the API server enforces. A test fails when this \
         page is stale (`DISTBELIEF_BLESS=1 cargo test -p distbelief-api spec_reference` rewrites it). \
         [Writing a job](job-spec.md) explains the sections with examples.\n",
    );
    section(&mut out, "spec", &schema["properties"]["spec"]);
    out
}

/// One object's section, then the sections of the objects in it.
fn section(out: &mut String, path: &str, schema: &Value) {
    let Some(fields) = schema["properties"].as_object() else {
        return;
    };
    *out += &format!("\n## {}\n\n", heading(path));
    let about = one_line(&schema["description"]);
    if !about.is_empty() {
        *out += &format!("{about}\n\n");
    }
    let rules: Vec<String> = schema["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["message"].as_str().map(str::to_string))
        .collect();
    if !rules.is_empty() {
        *out += "Rules the API server checks here:\n\n";
        for r in rules {
            *out += &format!("* {}\n", one_line(&Value::String(r)));
        }
        *out += "\n";
    }
    let required: Vec<&str> = schema["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    *out += "| Field | Type | Meaning |\n|---|---|---|\n";
    let mut nested = Vec::new();
    for (name, field) in fields {
        let child = format!("{path}.{name}");
        let (kind, inner) = kind_of(field, &child);
        let needed = if required.contains(&name.as_str()) {
            " (required)"
        } else {
            ""
        };
        *out += &format!(
            "| `{name}`{needed} | {kind} | {} |\n",
            one_line(&field["description"])
        );
        nested.extend(inner);
    }
    for (p, s) in nested {
        section(out, &p, s);
    }
}

/// A field's type as the reference shows it, and the object it holds, if
/// that object has a section of its own.
fn kind_of<'a>(f: &'a Value, path: &str) -> (String, Option<(String, &'a Value)>) {
    let link = |p: &str| format!("[{}](#{})", heading(p), anchor(&heading(p)));
    if f["x-kubernetes-preserve-unknown-fields"].as_bool() == Some(true) {
        return ("object (any fields)".into(), None);
    }
    if f["x-kubernetes-int-or-string"].as_bool() == Some(true) {
        return ("integer or string".into(), None);
    }
    match f["type"].as_str() {
        Some("object") if f["properties"].is_object() => (
            format!("object: {}", link(path)),
            Some((path.to_string(), f)),
        ),
        Some("object") => match f["additionalProperties"].as_object() {
            Some(v) => (
                format!("map of {}", kind_of(&Value::Object(v.clone()), path).0),
                None,
            ),
            None => ("object".into(), None),
        },
        Some("array") => {
            let items = &f["items"];
            if items["properties"].is_object() {
                let p = format!("{path} entries");
                (format!("list of {}", link(&p)), Some((p, items)))
            } else {
                (format!("list of {}", kind_of(items, path).0), None)
            }
        }
        _ => (type_of(f), None),
    }
}

/// `spec.a.b`, or `spec.a.b` entries for a list's items.
fn heading(path: &str) -> String {
    match path.strip_suffix(" entries") {
        Some(list) => format!("`{list}` entries"),
        None => format!("`{path}`"),
    }
}

/// GitHub's anchor for a heading: lowercased, punctuation dropped, spaces
/// as hyphens (what scripts/check-links.py checks links against).
fn anchor(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn one_line(v: &Value) -> String {
    v.as_str()
        .unwrap_or_default()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

fn type_of(f: &Value) -> String {
    if let Some(values) = f["enum"].as_array() {
        return values
            .iter()
            .filter_map(|v| v.as_str().map(|s| format!("`{s}`")))
            .collect::<Vec<_>>()
            .join(" \\| ");
    }
    f["type"].as_str().unwrap_or("object").to_string()
}

#[cfg(test)]
mod tests {
    /// docs/reference.md is generated from the schema. Run with
    /// `DISTBELIEF_BLESS=1` to rewrite it.
    #[test]
    fn spec_reference_is_generated_from_the_schema() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reference.md");
        let want = super::spec_reference();
        if std::env::var_os("DISTBELIEF_BLESS").is_some() {
            std::fs::write(&path, &want).expect("docs/reference.md is writable");
            return;
        }
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            text == want,
            "docs/reference.md is stale: run DISTBELIEF_BLESS=1 cargo test -p distbelief-api spec_reference"
        );
        for section in [
            "## `spec.model`",
            "## `spec.stop`",
            "## `spec.algorithm.downpour`",
        ] {
            assert!(want.contains(section), "{section}");
        }
        assert!(want.contains("| `evalSampleExamples` | integer |"));
    }

    /// The generated blocks of docs/job-spec.md match the schema. Run with
    /// `DISTBELIEF_BLESS=1` to rewrite them.
    #[test]
    fn readme_layers_table_is_generated_from_the_schema() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/job-spec.md");
        let text = std::fs::read_to_string(&path).expect("docs/job-spec.md");
        let (begin, end) = ("<!-- layers:begin -->\n", "<!-- layers:end -->");
        let start = text
            .find(begin)
            .expect("docs/job-spec.md has a layers block")
            + begin.len();
        let stop = start + text[start..].find(end).expect("the block ends");
        let want = super::layers_table();
        if std::env::var_os("DISTBELIEF_BLESS").is_some() {
            let new = format!("{}{want}{}", &text[..start], &text[stop..]);
            std::fs::write(&path, new).expect("docs/job-spec.md is writable");
            return;
        }
        assert_eq!(
            text[start..stop],
            want,
            "the layer table in docs/job-spec.md is stale: run DISTBELIEF_BLESS=1 cargo test -p distbelief-api readme_layers"
        );
        for kind in [
            "dense",
            "conv2d",
            "locallyConnected2d",
            "maxPool2d",
            "avgPool2d",
            "flatten",
        ] {
            assert!(want.contains(&format!("| `{kind}` |")), "{kind}");
        }
    }
}
