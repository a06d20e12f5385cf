//! Reference pages generated from the CRD's schema, whose text is the
//! spec's `///` docs: the README's table of layer kinds. A test compares the
//! committed text with this, so the docs cannot drift from the code.

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
    /// The README's generated blocks match the schema. Run with
    /// `DISTBELIEF_BLESS=1` to rewrite them.
    #[test]
    fn readme_layers_table_is_generated_from_the_schema() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
        let text = std::fs::read_to_string(&path).expect("README.md");
        let (begin, end) = ("<!-- layers:begin -->\n", "<!-- layers:end -->");
        let start = text.find(begin).expect("the README has a layers block") + begin.len();
        let stop = start + text[start..].find(end).expect("the block ends");
        let want = super::layers_table();
        if std::env::var_os("DISTBELIEF_BLESS").is_some() {
            let new = format!("{}{want}{}", &text[..start], &text[stop..]);
            std::fs::write(&path, new).expect("README.md is writable");
            return;
        }
        assert_eq!(
            text[start..stop],
            want,
            "the README's layer table is stale: run DISTBELIEF_BLESS=1 cargo test -p distbelief-api readme_layers"
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
