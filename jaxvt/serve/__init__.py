"""An OpenAI-compatible server over one resident model: a pure scheduler (slots, admission, a
bounded queue; jaxvt.serve.scheduler) decides which requests share each device step."""
