//! Numbers as reports print them: floats to six significant digits, so JSON says
//! `0.000512`, not `0.0005124999999999999`.

use serde::Serializer;

/// `x` rounded to `digits` significant digits (zero, infinities and NaN as they are).
#[must_use]
pub fn round_significant(x: f64, digits: usize) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    format!("{:.*e}", digits.max(1) - 1, x).parse().unwrap_or(x)
}

/// Serializes a float to six significant digits.
///
/// # Errors
/// As the serializer's.
pub fn six_digits<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(round_significant(*x, 6))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_keep_six_significant_digits_and_lose_their_noise() {
        assert_eq!(round_significant(0.000_512_499_999_999_999_9, 6), 0.000_512_5);
        assert_eq!(round_significant(4.321_934_017_833_33, 6), 4.321_93);
        assert_eq!(round_significant(0.989_087_072_631_960_7, 6), 0.989_087);
        assert_eq!(round_significant(0.0, 6), 0.0);
        #[derive(serde::Serialize)]
        struct Cost {
            #[serde(serialize_with = "six_digits")]
            usd: f64,
        }
        assert_eq!(serde_json::to_string(&Cost { usd: 0.025_807_200_000_000_002 }).unwrap(), r#"{"usd":0.0258072}"#);
    }
}
