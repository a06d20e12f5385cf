//! The shard address pattern and count a coordinator or replica reads from
//! its environment: `<pattern>\n<count>`.

use distbelief_api::addresses::{SHARD, ShardPattern};

pub fn shard_pattern(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (pattern, count) = text.split_once('\n').unwrap_or((text, ""));
    let Ok(p) = ShardPattern::parse(pattern, count) else {
        return;
    };
    let addresses = p.expand();
    assert_eq!(addresses.len(), p.shards() as usize * p.replication());
    // `{shard}` is replaced once, so a pattern's other braces survive; but
    // no address is left holding the placeholder it was made from twice.
    assert!(addresses.iter().all(|a| a.matches(SHARD).count() <= 1));
    assert_eq!(
        ShardPattern::parse(&p.pattern(), count),
        Ok(p),
        "round trip"
    );
}
